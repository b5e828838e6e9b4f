// Bit packing round trips for every width 1..8, lengths that are not multiples of a word, and
// unaligned bit offsets; dense sizes (3-bit codes: 3 bytes per 8). KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/simd/uniform_cpu.hpp"

namespace {

class BitpackTest : public ::testing::TestWithParam<int> {};

TEST_P(BitpackTest, RoundTripAllLengths) {
  const int bits = GetParam();
  std::mt19937 rng(bits);
  for (size_t n : {0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4099}) {
    std::vector<uint8_t> codes(n), back(n, 0xee);
    for (auto& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
    std::vector<uint8_t> packed(kvq::packed_bytes(n, bits), 0);
    EXPECT_EQ(packed.size(), (n * bits + 7) / 8);
    kvq::pack_bits(codes.data(), n, bits, packed.data());
    kvq::unpack_bits(packed.data(), n, bits, back.data());
    ASSERT_EQ(codes, back) << "bits=" << bits << " n=" << n;
    // The SIMD paths produce the same bytes.
    std::vector<uint8_t> packed2(packed.size(), 0), back2(n, 0xee);
    kvq::kernels::pack_codes(codes.data(), n, bits, packed2.data(), 0);
    ASSERT_EQ(packed, packed2) << "bits=" << bits << " n=" << n;
    kvq::kernels::unpack_codes(packed.data(), n, bits, back2.data(), 0);
    ASSERT_EQ(codes, back2) << "bits=" << bits << " n=" << n;
  }
}

TEST_P(BitpackTest, UnalignedOffsetsPreserveNeighbours) {
  const int bits = GetParam();
  std::mt19937 rng(100 + bits);
  for (size_t off : {0, 1, 3, 7, 8, 13, 24, 48}) {
    const size_t n = 37;
    std::vector<uint8_t> codes(n), back(n);
    for (auto& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
    std::vector<uint8_t> packed(kvq::packed_bytes(n, bits) + off / 8 + 2, 0xff);  // neighbours all ones
    kvq::pack_bits(codes.data(), n, bits, packed.data(), off);
    kvq::unpack_bits(packed.data(), n, bits, back.data(), off);
    ASSERT_EQ(codes, back) << "bits=" << bits << " off=" << off;
    std::vector<uint8_t> back2(n, 0xee);  // the SIMD / 3-bit paths from byte-aligned offsets
    kvq::kernels::unpack_codes(packed.data(), n, bits, back2.data(), off);
    ASSERT_EQ(codes, back2) << "unpack_codes bits=" << bits << " off=" << off;
    for (size_t b = 0; b < off; ++b) ASSERT_TRUE((packed[b / 8] >> (b % 8)) & 1) << b;
    const size_t end = off + n * bits;
    for (size_t b = end; b < packed.size() * 8; ++b)
      ASSERT_TRUE((packed[b / 8] >> (b % 8)) & 1) << "bit " << b << " clobbered";
  }
}

TEST_P(BitpackTest, LayoutIsLsbFirst) {
  const int bits = GetParam();
  std::vector<uint8_t> codes = {1, 0, 0, 0, 0, 0, 0, 0};
  std::vector<uint8_t> packed(kvq::packed_bytes(8, bits), 0);
  kvq::pack_bits(codes.data(), 8, bits, packed.data());
  EXPECT_EQ(packed[0], 1);
  codes = {0, 1, 0, 0, 0, 0, 0, 0};
  std::fill(packed.begin(), packed.end(), 0);
  kvq::pack_bits(codes.data(), 8, bits, packed.data());
  EXPECT_EQ(packed[bits / 8], 1 << (bits % 8));
}

// Codes with bits above the width pack as their masked values (the 64-bit chunk path of the
// 3-, 5-, 6- and 7-bit widths included): byte-aligned and unaligned offsets, a partial tail.
TEST_P(BitpackTest, HighBitsAreMasked) {
  const int bits = GetParam();
  std::mt19937 rng(200 + bits);
  for (size_t off : {0, 5, 16}) {
    const size_t n = 77;  // two 32-code blocks and a tail
    std::vector<uint8_t> raw(n), masked(n);
    for (size_t i = 0; i < n; ++i) {
      raw[i] = static_cast<uint8_t>(rng());
      masked[i] = static_cast<uint8_t>(raw[i] & ((1u << bits) - 1));
    }
    std::vector<uint8_t> a(kvq::packed_bytes(n, bits) + 4, 0x5a), b(a);
    kvq::pack_bits(raw.data(), n, bits, a.data(), off);
    kvq::pack_bits(masked.data(), n, bits, b.data(), off);
    ASSERT_EQ(a, b) << "bits=" << bits << " off=" << off;
    if (off % 8 == 0) {  // the SIMD paths of pack_codes (byte-aligned runs)
      std::vector<uint8_t> c(a.size(), 0x5a);
      kvq::kernels::pack_codes(raw.data(), n, bits, c.data(), off);
      ASSERT_EQ(c, b) << "pack_codes bits=" << bits << " off=" << off;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, BitpackTest, ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8),
                         [](const auto& i) { return "b" + std::to_string(i.param); });

TEST(Bitpack, DenseSizes) {
  EXPECT_EQ(kvq::packed_bytes(8, 3), 3u);
  EXPECT_EQ(kvq::packed_bytes(8, 5), 5u);
  EXPECT_EQ(kvq::packed_bytes(4, 6), 3u);
  EXPECT_EQ(kvq::packed_bytes(9, 3), 4u);
  EXPECT_EQ(kvq::packed_bytes(128, 2), 32u);
}

TEST(Bitpack, RejectsBadWidths) {
  uint8_t c = 0, p = 0;
  EXPECT_THROW(kvq::pack_bits(&c, 1, 0, &p), kvq::Error);
  EXPECT_THROW(kvq::pack_bits(&c, 1, 9, &p), kvq::Error);
  EXPECT_THROW(kvq::unpack_bits(&p, 1, 12, &c), kvq::Error);
}

}  // namespace
