#pragma once
/// \file reader.hpp
/// Reading archives (part of kvq/io/archive.hpp): parsing and validating the header, trailer,
/// footer and index, reading and checking records, restoring a KVCache, salvage messages;
/// ArchiveReader.
#include <set>
#include <tuple>

#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/io/archive/codec.hpp"

namespace kvq {
namespace io {

namespace detail {

/// Walks the records of a file whose trailer is missing or damaged and says where it ends:
/// after which complete record, inside which record (or footer), or where it is damaged.
inline std::string salvage_message(const Source& src, const std::string& name, uint64_t H,
                                   const std::string& trailer_problem) {
  const uint64_t size = src.size();
  uint64_t off = H;
  uint64_t n = 0;
  std::string last = "the header";
  std::array<uint8_t, kArchiveRecordHeaderBytes> h{};
  const std::string pre = cat(name, ": ");
  auto so_far = [&] {
    return n == 0 ? std::string("no complete record") : cat(n, " complete records (last: ", last, ")");
  };
  for (;;) {
    if (off == size)
      return cat(pre, "truncated or unfinished archive: ", trailer_problem, "; the file ends at byte ",
                 size, " right after ", last, " (", so_far(),
                 "), where another record or the footer and trailer should follow");
    if (off + 8 <= size) {
      uint8_t m[8];
      src.read(off, m, 8);
      if (std::memcmp(m, kArchiveFooterMagic, 8) == 0) {
        if (off + kArchiveFooterFixedBytes > size)
          return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                     " inside the footer (offset ", off, "), after ", so_far());
        uint8_t fsz[8];
        src.read(off + 16, fsz, 8);
        const uint64_t fb = get_u64(fsz);
        if (fb <= size - off && off + fb + kArchiveTrailerBytes == size)
          return cat(pre, "damaged trailer (last ", kArchiveTrailerBytes, " bytes, offset ",
                     size - kArchiveTrailerBytes, "): ", trailer_problem, "; ", so_far(),
                     " and the footer at offset ", off, " precede it");
        if (fb > size - off || off + fb + kArchiveTrailerBytes > size)
          return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                     " inside the footer (offset ", off, ", ", fb, " bytes) or the trailer after it, after ",
                     so_far());
        return cat(pre, "damaged archive: ", trailer_problem, "; the footer at offset ", off, " (", fb,
                   " bytes) and a trailer are followed by ", size - off - fb - kArchiveTrailerBytes,
                   " more bytes");
      }
    }
    if (off + kArchiveRecordHeaderBytes > size)
      return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                 " inside the header of record #", n, " (offset ", off, ") or of the footer, after ",
                 so_far());
    src.read(off, h.data(), h.size());
    ArchiveRecord r;
    std::string why;
    if (!decode_record_header(h.data(), &r, &why))
      return cat(pre, "damaged archive: ", trailer_problem, "; no valid record #", n, " at offset ", off,
                 " (", why, "), after ", so_far());
    r.offset = off;
    if (r.payload_bytes > size || off + r.extent() > size)
      return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                 " inside ", r.name(), ", whose payload of ", r.payload_bytes, " bytes starts at ",
                 r.payload_offset());
    last = r.name();
    off += r.extent();
    ++n;
  }
}

/// Validates the header, footer and trailer of `src` and returns what they say.
inline ArchiveInfo parse_archive(const Source& src, const std::string& name,
                                 const ArchiveReadOptions& opt) {
  KVQ_REQUIRE(host_little_endian(), kUnsupported, name,
              ": kvq archives are little-endian and this host is not; reading them here is not "
              "supported");
  const uint64_t size = src.size();
  ArchiveInfo info;
  info.source = name;
  info.file_bytes = size;

  // 1. The header's fixed part: magic, version, endianness, size, then its CRC.
  KVQ_REQUIRE(size >= 8, kIo, name, ": truncated: ", size,
              " bytes, shorter than the 8-byte magic of a kvq archive");
  uint8_t fx[kArchiveHeaderFixedBytes] = {};
  src.read(0, fx, std::min<uint64_t>(size, kArchiveHeaderFixedBytes));
  KVQ_REQUIRE(std::memcmp(fx, kArchiveMagic, 8) == 0, kIo, name,
              ": not a kvq archive: header (offset 0): the first 8 bytes are not the magic 89 4B "
              "56 51 41 0D 0A 1A");
  KVQ_REQUIRE(size >= kArchiveHeaderFixedBytes, kIo, name, ": truncated: the file ends at byte ",
              size, " inside the header's fixed part (", kArchiveHeaderFixedBytes, " bytes)");
  const uint32_t version = get_u32(fx + 8), marker = get_u32(fx + 12);
  const uint64_t H = get_u32(fx + 16);
  KVQ_REQUIRE(marker != 0x0D0C0B0Au, kUnsupported, name,
              ": written big-endian (endianness marker 0A 0B 0C 0D); kvq archives are little-endian");
  KVQ_REQUIRE(H >= kArchiveHeaderFixedBytes + 3 * kArchiveConfigBytes + 4 && H % kArchiveAlign == 0 &&
                  H <= kArchiveMaxHeaderBytes,
              kIo, name, ": header (offset 0): header size ", H,
              " is impossible (a multiple of 64, at least ",
              kArchiveHeaderFixedBytes + 3 * kArchiveConfigBytes + 4, ", at most ",
              kArchiveMaxHeaderBytes, ")", version != kArchiveVersion ? cat("; format version field reads ", version) : std::string());
  KVQ_REQUIRE(H <= size, kIo, name, ": truncated: the file ends at byte ", size,
              " inside the header (", H, " bytes)");
  std::vector<uint8_t> hb(static_cast<std::size_t>(H));
  src.read(0, hb.data(), hb.size());
  {
    const uint32_t want = get_u32(hb.data() + H - 4), got = crc32c(hb.data(), H - 4);
    KVQ_REQUIRE(want == got, kIo, name, ": header (offset 0, ", H, " bytes): CRC-32C mismatch (stored ",
                hex32(want), ", computed ", hex32(got), ")");
  }
  KVQ_REQUIRE(version == kArchiveVersion, kUnsupported, name, ": format version ", version,
              " (this kvq reads version ", kArchiveVersion, ")");
  KVQ_REQUIRE(marker == kArchiveEndianMarker, kIo, name, ": header: bad endianness marker ",
              hex32(marker));
  info.version = version;
  info.header_bytes = H;

  // 2. The trailer (then the salvage walk says where an unfinished file ends).
  std::string trailer_problem;
  uint8_t tr[kArchiveTrailerBytes] = {};
  if (size < H + kArchiveTrailerBytes) {
    trailer_problem = "no room for a trailer";
  } else {
    src.read(size - kArchiveTrailerBytes, tr, kArchiveTrailerBytes);
    const uint64_t fo = get_u64(tr), fb = get_u64(tr + 8);
    if (std::memcmp(tr + 24, kArchiveTrailerMagic, 8) != 0) {
      trailer_problem = "no trailer magic in the last 8 bytes";
    } else if (get_u32(tr + 20) != crc32c(tr, 20)) {
      trailer_problem = cat("trailer CRC-32C mismatch (stored ", hex32(get_u32(tr + 20)),
                            ", computed ", hex32(crc32c(tr, 20)), ")");
    } else if (fo < H || fo % kArchiveAlign != 0 || fb % kArchiveAlign != 0 ||
               fb < align_up(kArchiveFooterFixedBytes + 4) || fo > size || fb > size - fo ||
               fo + fb + kArchiveTrailerBytes != size) {
      trailer_problem = cat("trailer points at a footer of ", fb, " bytes at offset ", fo,
                            ", which does not end where the trailer starts (", size - kArchiveTrailerBytes, ")");
    } else {
      info.footer_offset = fo;
      info.footer_bytes = fb;
      info.file_crc = get_u32(tr + 16);
    }
  }
  if (!trailer_problem.empty()) fail(ErrorKind::kIo, salvage_message(src, name, H, trailer_problem));

  // 3. The header's fields.
  const uint8_t* b = hb.data();
  const uint32_t flags = get_u32(b + 20);
  const int32_t L = get_i32(b + 24), Hk = get_i32(b + 28), D = get_i32(b + 32), MT = get_i32(b + 36);
  const uint64_t n_cfg = get_u32(b + 56), spec_n = get_u32(b + 60), note_n = get_u32(b + 64);
  const uint32_t rope_style = get_u32(b + 68);
  const double rope_theta = get_f64(b + 72);
  const std::string hdr = name + ": header";
  KVQ_REQUIRE(flags <= 3, kIo, hdr, ": unknown flag bits ", hex32(flags));
  KVQ_REQUIRE(L >= 1 && L <= kArchiveMaxLayers && Hk >= 1 && Hk <= (1 << 24) && D >= 1 &&
                  D <= (1 << 24) && MT >= 0,
              kIo, hdr, ": impossible shape: ", L, " layers, ", Hk, " kv heads, head_dim ", D,
              ", max_tokens ", MT);
  KVQ_REQUIRE(n_cfg >= 3 && n_cfg % 2 == 1 && n_cfg <= 3 + 2 * static_cast<uint64_t>(L) &&
                  spec_n <= kArchiveMaxText && note_n <= kArchiveMaxText,
              kIo, hdr, ": impossible counts: ", n_cfg, " configs, spec of ", spec_n,
              " bytes, note of ", note_n, " bytes");
  const uint64_t body = kArchiveHeaderFixedBytes + n_cfg * kArchiveConfigBytes +
                        static_cast<uint64_t>(L) * kArchiveLayerGeomBytes + spec_n + note_n;
  KVQ_REQUIRE(align_up(body + 4) == H, kIo, hdr, ": its fields take ", body,
              " bytes, which does not give its size ", H);
  KVQ_REQUIRE(all_zero(b + 84, 12) && all_zero(b + body, static_cast<std::size_t>(H - 4 - body)), kIo,
              hdr, ": nonzero reserved or padding bytes");
  if (flags & 2) {
    KVQ_REQUIRE(rope_style <= 1 && std::isfinite(rope_theta) && rope_theta > 1.0, kIo, hdr,
                ": key RoPE style ", rope_style, ", theta ", rope_theta, " is not a RoPE config");
    RopeConfig rc;
    rc.theta = rope_theta;
    rc.style = rope_style == 1 ? RopeStyle::kHalf : RopeStyle::kAdjacent;
    info.key_rope = rc;
  } else {
    KVQ_REQUIRE(rope_style == 0 && get_u64(b + 72) == 0, kIo, hdr,
                ": a key RoPE config without the pre-RoPE flag");
  }
  info.n_layers = L;
  info.kv_heads = Hk;
  info.head_dim = D;
  info.max_tokens = MT;
  info.options.exact_rollback = (flags & 1) != 0;
  info.writer_version = get_u32(b + 80);
  Policy& p = info.policy;
  p.residual = get_i32(b + 40);
  p.sinks = get_i32(b + 44);
  p.skip_first = get_i32(b + 48);
  p.skip_last = get_i32(b + 52);
  std::size_t off = kArchiveHeaderFixedBytes;
  int prev_layer = -1;
  for (uint64_t i = 0; i < n_cfg; ++i, off += kArchiveConfigBytes) {
    const uint8_t* c = b + off;
    const int32_t layer = get_i32(c + 12);
    const auto at = [&] { return cat(hdr, ": config ", i, " (offset ", off, ")"); };
    const uint8_t want_role = i < 3 ? static_cast<uint8_t>(i)
                                    : static_cast<uint8_t>(i % 2 == 1 ? kRoleOverrideKey : kRoleOverrideValue);
    KVQ_REQUIRE(c[0] == want_role, kIo, at(), ": role ", int{c[0]}, " where role ", int{want_role},
                " belongs (key, value, skip, then key/value pairs of overrides)");
    const QuantConfig q = decode_config(c, at);
    if (i == 0) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.key = q;
    } else if (i == 1) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.value = q;
    } else if (i == 2) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.skip_config = q;
    } else if (i % 2 == 1) {
      KVQ_REQUIRE(layer > prev_layer && layer < L, kIo, at(), ": override of layer ", layer,
                  " (overrides name layers in [0, ", L, ") in increasing order)");
      prev_layer = layer;
      p.overrides[layer].first = q;
    } else {
      KVQ_REQUIRE(layer == prev_layer, kIo, at(), ": value override of layer ", layer,
                  " after the key override of layer ", prev_layer);
      p.overrides[layer].second = q;
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> geom(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l, off += kArchiveLayerGeomBytes) {
    KVQ_REQUIRE(all_zero(b + off + 8, 8), kIo, hdr, ": layer ", l, " geometry: nonzero reserved bytes");
    geom[static_cast<std::size_t>(l)] = {get_u32(b + off), get_u32(b + off + 4)};
  }
  info.spec.assign(reinterpret_cast<const char*>(b + off), static_cast<std::size_t>(spec_n));
  off += static_cast<std::size_t>(spec_n);
  info.note.assign(reinterpret_cast<const char*>(b + off), static_cast<std::size_t>(note_n));
  try {
    p.validate();
    for (const auto& kv : p.overrides)
      KVQ_REQUIRE(kv.first < L, kInvalidArgument, "override of layer ", kv.first);
  } catch (const Error& e) {
    fail(ErrorKind::kIo, hdr, ": invalid policy: ", e.what());
  }
  try {
    KVQ_REQUIRE(parse_policy(info.spec) == spec_part(p), kIo, "does not describe the stored configs (",
                p.spec(), ")");
  } catch (const Error& e) {
    fail(ErrorKind::kIo, hdr, ": policy spec '", info.spec, "': ", e.what());
  }

  // Per-layer geometry, recomputed as the cache computes it and compared with the header's.
  const uint64_t row = static_cast<uint64_t>(Hk) * static_cast<uint64_t>(D);
  uint64_t construct = static_cast<uint64_t>(L) * (::kvq::detail::KVCacheAccess::layer_struct_bytes() + 256);
  info.layers.resize(static_cast<std::size_t>(L));
  // Rotate-then-Lloyd-Max contexts the cache will build (one per distinct bits and seed; a QJL
  // one holds a head_dim x head_dim matrix): counted in the bound below.
  std::set<std::tuple<int, uint64_t, bool>> lm_contexts;
  uint64_t lm_bytes = 0;
  for (int l = 0; l < L; ++l) {
    ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    try {
      const QuantConfig kc = ::kvq::detail::streaming_config(p.key_for(l, L));
      const QuantConfig vc = ::kvq::detail::streaming_config(p.value_for(l, L));
      for (const QuantConfig* c : {&kc, &vc}) {
        if (c->format != Format::kLloydMax) continue;
        KVQ_REQUIRE(!c->qjl || D <= ::kvq::detail::kMaxQjlHeadDim, kUnsupported, "QJL keys at head_dim ",
                    D, " exceed kvq's QJL limit of ", ::kvq::detail::kMaxQjlHeadDim);
        if (lm_contexts.insert({c->bits, c->seed, c->qjl}).second)
          lm_bytes += ::kvq::detail::lloyd_max_context_bytes(D, c->qjl);
      }
      A.block_tokens = ::kvq::detail::stream_block_tokens(kc, vc);
      KVQ_REQUIRE(static_cast<double>(A.block_tokens) * static_cast<double>(row) * 4.0 <=
                      static_cast<double>(kMaxPageBytes),
                  kOutOfRange, "blocks of ", A.block_tokens, " tokens x ", Hk, " x ", D,
                  " exceed the cache's staging limit");
      A.layout = make_page_layout(kc, vc, A.block_tokens, Hk, D);
    } catch (const Error& e) {
      fail(ErrorKind::kIo, hdr, ": layer ", l, ": this policy and shape cannot form a cache: ", e.what());
    }
    const auto& g = geom[static_cast<std::size_t>(l)];
    KVQ_REQUIRE(g.first == static_cast<uint64_t>(A.block_tokens) && g.second == A.layout.bytes, kIo, hdr,
                ": layer ", l, " stores pages of ", g.first, " tokens and ", g.second,
                " bytes, but its policy and shape give ", A.block_tokens, " tokens and ", A.layout.bytes,
                " bytes (an archive from an incompatible kvq)");
    construct = std::max(construct, static_cast<uint64_t>(L) * 512 +
                                        16 * static_cast<uint64_t>(A.block_tokens) * row +
                                        2 * static_cast<uint64_t>(A.layout.bytes));
  }
  construct += lm_bytes;
  const uint64_t limit = opt.max_cache_bytes ? opt.max_cache_bytes
                                             : std::max<uint64_t>(uint64_t{64} << 20, 16 * size);
  KVQ_REQUIRE(construct <= limit, kIo, hdr, ": the cache it declares (", L, " layers of ", Hk,
              " x ", D, ") would take about ", construct, " bytes to set up before any token is read, "
              "beyond the reader's limit of ", limit,
              " bytes for a file of ", size, " bytes (ArchiveReadOptions::max_cache_bytes)");

  // 4. The footer.
  const uint64_t fo = info.footer_offset, fb = info.footer_bytes;
  const auto ftr = [&] { return cat(name, ": footer (offset ", fo, ", ", fb, " bytes)"); };
  std::vector<uint8_t> fbuf(static_cast<std::size_t>(fb));
  src.read(fo, fbuf.data(), fbuf.size());
  const uint8_t* f = fbuf.data();
  {
    const uint32_t want = get_u32(f + fb - 4), got = crc32c(f, fb - 4);
    KVQ_REQUIRE(want == got, kIo, ftr(), ": CRC-32C mismatch (stored ", hex32(want), ", computed ",
                hex32(got), ")");
  }
  KVQ_REQUIRE(std::memcmp(f, kArchiveFooterMagic, 8) == 0, kIo, ftr(), ": no footer magic");
  const uint64_t N = get_u64(f + 8);
  KVQ_REQUIRE(get_u64(f + 16) == fb && get_i32(f + 24) == L && all_zero(f + 28, 4), kIo, ftr(),
              ": its size field (", get_u64(f + 16), ") or layer count (", get_i32(f + 24),
              ") disagrees with the trailer and header (", fb, ", ", L, ")");
  KVQ_REQUIRE(N <= fb / kArchiveIndexEntryBytes &&
                  align_up(kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                           static_cast<uint64_t>(L) * kArchiveLayerEntryBytes + 4) == fb,
              kIo, ftr(), ": ", N, " records and ", L, " layers do not give its size");
  const uint64_t fbody = kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                         static_cast<uint64_t>(L) * kArchiveLayerEntryBytes;
  KVQ_REQUIRE(all_zero(f + fbody, static_cast<std::size_t>(fb - 4 - fbody)), kIo, ftr(),
              ": nonzero padding");
  info.records.resize(static_cast<std::size_t>(N));
  uint64_t expect_off = H;
  for (uint64_t i = 0; i < N; ++i) {
    const uint8_t* e = f + kArchiveFooterFixedBytes + i * kArchiveIndexEntryBytes;
    ArchiveRecord& r = info.records[static_cast<std::size_t>(i)];
    r.seq = i;
    r.offset = get_u64(e);
    r.payload_bytes = get_u64(e + 8);
    r.layer = get_i32(e + 16);
    const uint16_t kind = get_u16(e + 20);
    r.kind = static_cast<RecordKind>(kind);
    r.index = get_i64(e + 24);
    r.begin = get_i64(e + 32);
    r.end = get_i64(e + 40);
    r.payload_crc = get_u32(e + 48);
    r.header_crc = get_u32(e + 52);
    const auto at = [&] { return cat(ftr(), ": index entry ", i, " (", r.name(), ")"); };
    KVQ_REQUIRE(all_zero(e + 22, 2) && all_zero(e + 56, 8), kIo, at(), ": nonzero reserved bytes");
    KVQ_REQUIRE(kind >= 1 && kind <= 4, kIo, at(), ": unknown record kind ", kind);
    KVQ_REQUIRE(r.layer >= 0 && r.layer < L, kIo, at(), ": layer ", r.layer, " of ", L);
    KVQ_REQUIRE(r.offset == expect_off, kIo, at(), ": starts at offset ", r.offset, ", but the ",
                i == 0 ? "header ends" : "previous record ends", " at ", expect_off,
                " (records are stored back to back)");
    KVQ_REQUIRE(r.payload_bytes <= fo && r.extent() <= fo - r.offset, kIo, at(), ": payload of ",
                r.payload_bytes, " bytes runs past the footer at ", fo);
    expect_off = r.offset + r.extent();
    info.layers[static_cast<std::size_t>(r.layer)].records.push_back(static_cast<std::size_t>(i));
  }
  KVQ_REQUIRE(expect_off == fo, kIo, ftr(), ": the records end at ", expect_off,
              " but the footer starts at ", fo);

  // 5. Per-layer token counts, and each layer's records against them.
  const int64_t S = p.sinks, R = p.residual;
  for (int l = 0; l < L; ++l) {
    ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    const uint8_t* e = f + kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                       static_cast<uint64_t>(l) * kArchiveLayerEntryBytes;
    const auto at = [&] { return cat(ftr(), ": layer ", l); };
    A.tokens = get_i64(e);
    A.sink_tokens = get_i64(e + 8);
    A.pages = get_i64(e + 16);
    A.residual_tokens = get_i64(e + 24);
    const uint32_t lf = get_u32(e + 32);
    KVQ_REQUIRE(lf <= 1 && all_zero(e + 36, 12), kIo, at(), ": unknown flags or nonzero reserved bytes");
    A.rollback = lf == 1;
    const int64_t B = A.block_tokens;
    const bool counts_ok =
        A.sink_tokens >= 0 && A.pages >= 0 && A.residual_tokens >= 0 &&
        A.pages <= static_cast<int64_t>(N) && A.sink_tokens <= S && A.residual_tokens <= R + B - 1 &&
        A.tokens == A.sink_tokens + A.pages * B + A.residual_tokens &&
        A.sink_tokens == std::min<int64_t>(A.tokens, S) && (MT == 0 || A.tokens <= MT) &&
        (!A.rollback || (A.pages >= 1 && info.options.exact_rollback));
    KVQ_REQUIRE(counts_ok, kIo, at(), ": ", A.tokens, " tokens as ", A.sink_tokens, " sinks + ",
                A.pages, " pages of ", B, " + ", A.residual_tokens, " residual",
                A.rollback ? " with rollback rows" : "",
                " is not a state a cache can be in (policy sinks=", S, ", residual=", R,
                MT ? cat(", max_tokens=", MT) : std::string(), ")");
    std::vector<int64_t> seen_page(static_cast<std::size_t>(A.pages), -1);
    int64_t seen[5] = {-1, -1, -1, -1, -1};
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info.records[ri];
      const auto rat = [&] { return cat(name, ": ", r.name()); };
      int64_t b0 = 0, b1 = 0, rows = 0;
      uint64_t bytes = 0;
      switch (r.kind) {
        case RecordKind::kPage:
          KVQ_REQUIRE(r.index >= 0 && r.index < A.pages, kIo, rat(), ": page index beyond the ", A.pages,
                      " pages of layer ", l);
          KVQ_REQUIRE(seen_page[static_cast<std::size_t>(r.index)] < 0, kIo, rat(), ": layer ", l,
                      " page ", r.index, " is also record #", seen_page[static_cast<std::size_t>(r.index)],
                      " (duplicated record)");
          seen_page[static_cast<std::size_t>(r.index)] = static_cast<int64_t>(r.seq);
          b0 = A.sink_tokens + r.index * B;
          b1 = b0 + B;
          bytes = A.layout.bytes;
          break;
        case RecordKind::kSinks:
          b0 = 0;
          b1 = rows = A.sink_tokens;
          break;
        case RecordKind::kResidual:
          b0 = A.packed_end();
          b1 = A.tokens;
          rows = A.residual_tokens;
          break;
        case RecordKind::kRollback:
          KVQ_REQUIRE(A.rollback, kIo, rat(), ": rollback rows for a layer whose footer entry has none");
          b0 = A.packed_end() - B;
          b1 = A.packed_end();
          rows = B;
          break;
      }
      if (r.kind != RecordKind::kPage) {
        const auto k = static_cast<std::size_t>(r.kind);
        KVQ_REQUIRE(seen[k] < 0, kIo, rat(), ": layer ", l, " has a second ", to_string(r.kind),
                    " record (the first is record #", seen[k], ": duplicated record)");
        seen[k] = static_cast<int64_t>(r.seq);
        KVQ_REQUIRE(r.index == 0 && rows > 0, kIo, rat(), ": an f32 region of ", rows,
                    " tokens cannot be record index ", r.index);
        bytes = 2 * static_cast<uint64_t>(rows) * row * 4;
      }
      KVQ_REQUIRE(r.begin == b0 && r.end == b1 && r.payload_bytes == bytes, kIo, rat(),
                  ": layer ", l, "'s ", to_string(r.kind), " should cover tokens [", b0, ", ", b1,
                  ") in ", bytes, " bytes");
    }
    for (int64_t j = 0; j < A.pages; ++j)
      KVQ_REQUIRE(seen_page[static_cast<std::size_t>(j)] >= 0, kIo, ftr(), ": layer ", l, " page ", j,
                  " has no record");
    KVQ_REQUIRE((seen[2] >= 0) == (A.sink_tokens > 0) && (seen[3] >= 0) == (A.residual_tokens > 0) &&
                    (seen[4] >= 0) == A.rollback,
                kIo, ftr(), ": layer ", l, " lacks its ",
                (seen[2] >= 0) != (A.sink_tokens > 0) ? "sinks"
                : (seen[3] >= 0) != (A.residual_tokens > 0) ? "residual"
                                                             : "rollback",
                " record");
    // Records of a layer in a fixed order: sinks, pages by index, residual, rollback.
    std::sort(A.records.begin(), A.records.end(), [&](std::size_t x, std::size_t y) {
      const ArchiveRecord &a = info.records[x], &c = info.records[y];
      auto key = [](const ArchiveRecord& r) {
        const int o = r.kind == RecordKind::kSinks ? 0 : r.kind == RecordKind::kPage ? 1
                      : r.kind == RecordKind::kResidual ? 2 : 3;
        return std::pair<int, int64_t>(o, r.index);
      };
      return key(a) < key(c);
    });
  }
  return info;
}

/// Checks f32 rows restored from `r` as KVCache::append checks what it accepts: finite
/// everywhere; for rows that will be (or were) quantized under `cfg` (residual, rollback) also
/// |x| <= 65504 where the format stores fp16, and Lloyd-Max norms <= 65504 with fp16 norms.
inline void check_rows(const std::string& name, const ArchiveRecord& r, const float* x, int64_t rows,
                       int64_t H, int64_t D, const QuantConfig& cfg, bool quantized, const char* what) {
  const bool f16_range = quantized && ::kvq::detail::needs_f16_range(cfg);
  const bool norm_range = quantized && cfg.format == Format::kLloydMax && cfg.meta == MetaDType::kF16;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* v = x + (t * H + h) * D;
      double n2 = 0;
      for (int64_t d = 0; d < D; ++d) {
        KVQ_REQUIRE(std::isfinite(v[d]) && (!f16_range || std::fabs(v[d]) <= kMaxF16Magnitude), kIo,
                    name, ": ", r.name(), ": ", what, " of token ", r.begin + t, ", head ", h,
                    ", channel ", d, " is ", v[d],
                    std::isfinite(v[d]) ? ", beyond the fp16 range the layer's format stores"
                                        : "; a cache holds finite values only");
        n2 += static_cast<double>(v[d]) * v[d];
      }
      KVQ_REQUIRE(!norm_range || std::sqrt(n2) <= kMaxF16Magnitude, kIo, name, ": ", r.name(), ": ",
                  what, " of token ", r.begin + t, ", head ", h, " has norm ", std::sqrt(n2),
                  ", beyond the fp16 range of the layer's Lloyd-Max norms");
    }
}

/// Checks what a page's bytes hold that a CRC cannot vouch for (a hostile writer reseals), so
/// that every reader of the page (dequantize, the fused CPU kernels, CUDA) agrees on it:
///  - every dense-and-sparse outlier position is a channel (< head_dim), since the kernels
///    index codes and queries by it, and no vector lists a channel twice (the fused kernels add
///    one correction per entry where dequantize keeps the last);
///  - every metadata value (scales, zero points, norms, QJL norms, outlier values) is finite:
///    fp16/f32 slots without an all-ones exponent, NVFP4 e4m3 scales not 0x7F/0xFF, MXFP4 e8m0
///    scales at most 252 (255 is E8M0's NaN; 253 and 254 are codes mx_scale_code never writes
///    for a finite block, and 6 x 2^126 overflows float: the kernels would read an infinity).
/// A page that breaks either is refused, naming the record, tensor, region and byte. Archive
/// pages are whole pages (partial ones travel as f32 residual rows), so every vector is checked.
/// Largest MXFP4 scale code a finite block gets: floor(log2(FLT_MAX)) + 127 - 2.
inline constexpr uint8_t kMaxMxScaleCode = 252;

inline void check_page_outliers(const ArchiveInfo& info, const ArchiveRecord& r,
                                const uint8_t* page, std::size_t bytes) {
  const PageLayout& L = info.layers[static_cast<std::size_t>(r.layer)].layout;
  const int64_t D = info.head_dim;
  const auto vectors = static_cast<std::size_t>(L.page_tokens * L.kv_heads);
  const int pb = outlier_pos_bytes(D);
  const TensorRegions* tensors[2] = {&L.k, &L.v};
  const QuantConfig* configs[2] = {&L.key, &L.value};
  std::vector<int64_t> seen;
  for (int t = 0; t < 2; ++t) {
    const char* tname = t == 0 ? "key" : "value";
    const TensorRegions& R = *tensors[t];
    const QuantConfig& cfg = *configs[t];
    auto within = [&](const PageRegion& g, const char* what) {
      KVQ_REQUIRE(g.offset + g.bytes <= bytes, kIo, info.source, ": ", r.name(), ": ", bytes,
                  " payload bytes do not hold the ", tname, " ", what, " the layout places at [",
                  g.offset, ", ", g.offset + g.bytes, ")");
    };
    // Outlier positions: channels, distinct within each vector.
    const PageRegion& g = R.outlier_pos;
    const auto per = static_cast<std::size_t>(outlier_count(cfg, D));
    if (g.bytes > 0 && per > 0) {
      within(g, "outlier positions");
      const uint8_t* p = page + g.offset;
      const std::size_t n = std::min(vectors * per, g.bytes / static_cast<std::size_t>(pb));
      for (std::size_t v0 = 0; v0 < n; v0 += per) {
        seen.clear();
        for (std::size_t i = v0; i < v0 + per && i < n; ++i) {
          const std::size_t at = i * static_cast<std::size_t>(pb);
          const int64_t c = pb == 1 ? p[at] : (p[at] | (p[at + 1] << 8));
          KVQ_REQUIRE(c < D, kIo, info.source, ": ", r.name(), ": ", tname, " outlier position ", c,
                      " at page byte ", g.offset + at, " is not a channel of head_dim ", D,
                      " (corrupt or hostile page)");
          seen.push_back(c);
        }
        std::sort(seen.begin(), seen.end());
        const auto dup = std::adjacent_find(seen.begin(), seen.end());
        KVQ_REQUIRE(dup == seen.end(), kIo, info.source, ": ", r.name(), ": ", tname,
                    " outlier position ", dup == seen.end() ? 0 : *dup, " appears twice in vector ",
                    v0 / per, " of the page (positions at page bytes [", g.offset + v0 * pb, ", ",
                    g.offset + (v0 + per) * pb, ")): each channel is an outlier at most once");
      }
    }
    // Metadata: finite.
    auto meta = [&](const PageRegion& m, int slot, const char* what, bool fp4_scale) {
      if (m.bytes == 0) return;
      within(m, what);
      const uint8_t* p = page + m.offset;
      for (std::size_t i = 0; i + static_cast<std::size_t>(slot) <= m.bytes; i += static_cast<std::size_t>(slot)) {
        bool bad;
        if (fp4_scale)
          bad = cfg.format == Format::kNvfp4 ? (p[i] & 0x7F) == 0x7F : p[i] > kMaxMxScaleCode;
        else if (slot == 2)
          bad = ((p[i] | (p[i + 1] << 8)) & 0x7C00) == 0x7C00;
        else
          bad = ((static_cast<uint32_t>(p[i]) | static_cast<uint32_t>(p[i + 1]) << 8 |
                  static_cast<uint32_t>(p[i + 2]) << 16 | static_cast<uint32_t>(p[i + 3]) << 24) &
                 0x7F800000u) == 0x7F800000u;
        KVQ_REQUIRE(!bad, kIo, info.source, ": ", r.name(), ": ", tname, " ", what, " at page byte ",
                    m.offset + i, fp4_scale && cfg.format == Format::kMxfp4
                        ? cat(" is E8M0 code ", int{p[i]}, ", beyond ", int{kMaxMxScaleCode},
                              " (NaN, or a scale no finite block gets)")
                        : std::string(" is NaN or infinite"),
                    " (corrupt or hostile page; a cache stores finite metadata only)");
      }
    };
    const int msz = meta_size(cfg.meta);
    meta(R.scales, static_cast<int>(scale_slot_bytes(cfg)), "scales", is_fp4(cfg.format));
    meta(R.zeros, static_cast<int>(scale_slot_bytes(cfg)), "zero points", false);
    meta(R.norms, msz, "norms", false);
    meta(R.qjl_norms, msz, "QJL norms", false);
    meta(R.outlier_values, 2, "outlier values", false);
  }
}

/// Reads record `r`: its header at r.offset must be the one the index describes (else it is
/// named as reordered, duplicated or damaged), its payload goes to `dst` (nullptr: checked in
/// place when the source is in memory, or through a scratch buffer) and must match its CRC, its
/// padding must be zero; a page's outlier positions must be channels (check_page_outliers).
/// Returns the CRC-32C of the record's bytes continued from `file_crc`.
inline uint32_t read_record(const Source& src, const ArchiveInfo& info, const ArchiveRecord& r,
                            void* dst, uint32_t file_crc, std::vector<uint8_t>& scratch) {
  const std::string& name = info.source;
  std::array<uint8_t, kArchiveRecordHeaderBytes> h{};
  src.read(r.offset, h.data(), h.size());
  ArchiveRecord got;
  std::string why;
  if (!decode_record_header(h.data(), &got, &why))
    fail(ErrorKind::kIo, name, ": ", r.name(), ": ", why);
  got.offset = r.offset;
  if (!same_identity(got, r)) {
    std::string found = got.name();
    if (got.seq < info.records.size() && same_identity(got, info.records[static_cast<std::size_t>(got.seq)]))
      found = cat(found.substr(0, found.rfind(", offset")), ", which belongs at offset ",
                  info.records[static_cast<std::size_t>(got.seq)].offset, ")");
    fail(ErrorKind::kIo, name, ": ", r.name(), ": the record stored there is ", found,
         ": records reordered, duplicated or overwritten");
  }
  file_crc = crc32c(h.data(), h.size(), file_crc);
  const auto n = static_cast<std::size_t>(r.payload_bytes);
  const uint8_t* payload = nullptr;
  if (dst != nullptr) {
    src.read(r.payload_offset(), dst, n);
    payload = static_cast<const uint8_t*>(dst);
  } else if (src.data() != nullptr) {
    payload = src.data() + r.payload_offset();
  } else {
    scratch.resize(n);
    src.read(r.payload_offset(), scratch.data(), n);
    payload = scratch.data();
  }
  const uint32_t pc = crc32c(payload, n);
  KVQ_REQUIRE(pc == r.payload_crc, kIo, name, ": ", r.name(), ": payload CRC-32C mismatch (stored ",
              hex32(r.payload_crc), ", computed ", hex32(pc), ")");
  if (r.kind == RecordKind::kPage) check_page_outliers(info, r, payload, n);
  file_crc = crc32c(payload, n, file_crc);
  const std::size_t pad = static_cast<std::size_t>(r.extent() - kArchiveRecordHeaderBytes - r.payload_bytes);
  if (pad > 0) {
    uint8_t z[kArchiveAlign];
    src.read(r.payload_offset() + r.payload_bytes, z, pad);
    for (std::size_t i = 0; i < pad; ++i)
      KVQ_REQUIRE(z[i] == 0, kIo, name, ": ", r.name(), ": nonzero padding byte at offset ",
                  r.payload_offset() + r.payload_bytes + i);
    file_crc = crc32c(z, pad, file_crc);
  }
  return file_crc;
}

/// Reads the header and footer bytes again and returns the CRC of the header (the start of the
/// whole-file checksum) — parse_archive does not keep them.
inline uint32_t header_crc_start(const Source& src, const ArchiveInfo& info) {
  std::vector<uint8_t> hb(static_cast<std::size_t>(info.header_bytes));
  src.read(0, hb.data(), hb.size());
  return crc32c(hb.data(), hb.size());
}
inline uint32_t footer_crc_continue(const Source& src, const ArchiveInfo& info, uint32_t crc) {
  std::vector<uint8_t> fb(static_cast<std::size_t>(info.footer_bytes));
  src.read(info.footer_offset, fb.data(), fb.size());
  return crc32c(fb.data(), fb.size(), crc);
}
inline void check_file_crc(const ArchiveInfo& info, uint32_t got) {
  KVQ_REQUIRE(got == info.file_crc, kIo, info.source, ": whole-file CRC-32C mismatch (stored ",
              hex32(info.file_crc), " in the trailer, computed ", hex32(got),
              ") although the header, every record and the footer check out");
}

/// A cache shaped as the archive says, empty (construction errors are the file's fault).
inline KVCache empty_cache(const ArchiveInfo& info) {
  try {
    return KVCache(info.policy, info.n_layers, info.kv_heads, info.head_dim, info.max_tokens,
                   info.options);
  } catch (const Error& e) {
    fail(ErrorKind::kIo, info.source, ": header: this policy and shape cannot form a cache: ", e.what());
  }
}

/// The f32 rows of one layer read from the archive (keys and values of each region).
struct LayerRows {
  std::vector<float> sk, sv, rk, rv, ok, ov;
  bool roll = false;
};

/// Checks the keys and values of an f32 record of layer `l` (check_rows).
inline void check_layer_rows(const ArchiveInfo& info, int l, const ArchiveRecord& r, const std::vector<float>& buf,
                             int64_t rows, bool quantized) {
  const ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
  const int64_t H = info.kv_heads, D = info.head_dim;
  const auto half = static_cast<std::size_t>(rows * H * D);
  check_rows(info.source, r, buf.data(), rows, H, D, A.layout.key, quantized, "key");
  check_rows(info.source, r, buf.data() + half, rows, H, D, A.layout.value, quantized, "value");
}

inline void split_rows(std::vector<float>&& buf, std::vector<float>& k, std::vector<float>& v) {
  const std::size_t half = buf.size() / 2;
  v.assign(buf.begin() + static_cast<std::ptrdiff_t>(half), buf.end());
  buf.resize(half);
  k = std::move(buf);
}

/// Loads the selected records of `info` from `src` into a new cache (see ArchiveReader::load).
inline KVCache load_cache(const Source& src, const ArchiveInfo& info, const ArchiveSelection& sel,
                          bool whole_file_crc) {
  const int L = info.n_layers;
  std::vector<char> want_layer(static_cast<std::size_t>(L), sel.layers.empty() ? 1 : 0);
  for (int l : sel.layers) {
    KVQ_REQUIRE(l >= 0 && l < L, kInvalidArgument, info.source, ": layer ", l,
                " does not exist (the archive has ", L, " layers)");
    want_layer[static_cast<std::size_t>(l)] = 1;
  }
  KVQ_REQUIRE(sel.tokens >= -1, kInvalidArgument, info.source, ": token prefix ", sel.tokens,
              " (use -1 for all tokens)");
  // Which records to read: per layer, those a prefix of `tokens` needs (see truncate()).
  std::vector<char> want(info.records.size(), 0);
  std::vector<int64_t> keep(static_cast<std::size_t>(L), 0);
  std::vector<int64_t> pages(static_cast<std::size_t>(L), 0);
  for (int l = 0; l < L; ++l) {
    const ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    if (!want_layer[static_cast<std::size_t>(l)]) continue;
    const int64_t n = sel.tokens < 0 ? A.tokens : std::min(sel.tokens, A.tokens);
    keep[static_cast<std::size_t>(l)] = n;
    int64_t np = 0;
    for (int64_t j = 0; j < A.pages; ++j)
      if (A.sink_tokens + j * A.block_tokens < n) np = j + 1;
    pages[static_cast<std::size_t>(l)] = np;
    const bool all_pages = np == A.pages;
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info.records[ri];
      bool w = false;
      switch (r.kind) {
        case RecordKind::kSinks: w = n > 0; break;
        case RecordKind::kPage: w = r.index < np; break;
        case RecordKind::kResidual: w = all_pages && n > A.packed_end(); break;
        case RecordKind::kRollback: w = all_pages && np > 0 && info.options.exact_rollback; break;
      }
      want[ri] = w ? 1 : 0;
    }
  }
  KVCache cache = empty_cache(info);
  using Access = ::kvq::detail::KVCacheAccess;
  for (int l = 0; l < L; ++l) Access::reserve_pages(cache, l, static_cast<std::size_t>(pages[static_cast<std::size_t>(l)]));
  std::vector<LayerRows> rows(static_cast<std::size_t>(L));
  std::vector<uint8_t> scratch;
  uint32_t fcrc = whole_file_crc ? header_crc_start(src, info) : 0;
  for (const ArchiveRecord& r : info.records) {
    if (!whole_file_crc && !want[static_cast<std::size_t>(r.seq)]) continue;
    if (!want[static_cast<std::size_t>(r.seq)]) {
      fcrc = read_record(src, info, r, nullptr, fcrc, scratch);
      continue;
    }
    const int l = r.layer;
    if (r.kind == RecordKind::kPage) {
      fcrc = read_record(src, info, r, Access::page_slot(cache, l, static_cast<std::size_t>(r.index)), fcrc, scratch);
      continue;
    }
    std::vector<float> buf(static_cast<std::size_t>(r.payload_bytes / 4));
    fcrc = read_record(src, info, r, buf.data(), fcrc, scratch);
    const int64_t n_rows = r.end - r.begin;
    check_layer_rows(info, l, r, buf, n_rows, r.kind != RecordKind::kSinks);
    LayerRows& R = rows[static_cast<std::size_t>(l)];
    if (r.kind == RecordKind::kSinks) split_rows(std::move(buf), R.sk, R.sv);
    if (r.kind == RecordKind::kResidual) split_rows(std::move(buf), R.rk, R.rv);
    if (r.kind == RecordKind::kRollback) {
      split_rows(std::move(buf), R.ok, R.ov);
      R.roll = true;
    }
  }
  if (whole_file_crc) check_file_crc(info, footer_crc_continue(src, info, fcrc));
  for (int l = 0; l < L; ++l) {
    LayerRows& R = rows[static_cast<std::size_t>(l)];
    Access::commit(cache, l, static_cast<std::size_t>(pages[static_cast<std::size_t>(l)]), std::move(R.sk),
                   std::move(R.sv), std::move(R.rk), std::move(R.rv), std::move(R.ok), std::move(R.ov),
                   R.roll);
  }
  if (sel.tokens >= 0)  // as truncate(): a cut may also unpack the newest page (exact rollback)
    for (int l = 0; l < L; ++l)
      if (want_layer[static_cast<std::size_t>(l)]) cache.truncate(l, keep[static_cast<std::size_t>(l)]);
  return cache;
}

/// Every byte of the archive: each record (header against the index, payload CRC, padding)
/// and the whole-file CRC.
inline void verify_all(const Source& src, const ArchiveInfo& info) {
  std::vector<uint8_t> scratch;
  std::vector<float> rows_buf;
  uint32_t fcrc = header_crc_start(src, info);
  for (const ArchiveRecord& r : info.records) {
    if (r.kind == RecordKind::kPage) {
      fcrc = read_record(src, info, r, nullptr, fcrc, scratch);
    } else {
      rows_buf.resize(static_cast<std::size_t>(r.payload_bytes / 4));
      fcrc = read_record(src, info, r, rows_buf.data(), fcrc, scratch);
      check_layer_rows(info, r.layer, r, rows_buf, r.end - r.begin, r.kind != RecordKind::kSinks);
    }
  }
  check_file_crc(info, footer_crc_continue(src, info, fcrc));
}

}  // namespace detail

/// Reads an archive from a file (positioned reads; only the records asked for) or from memory.
/// The constructor validates the header, trailer and footer (not the payloads: see verify()).
class ArchiveReader {
 public:
  explicit ArchiveReader(const std::filesystem::path& path, const ArchiveReadOptions& opt = {})
      : src_(std::make_unique<detail::FileSource>(path)),
        info_(detail::parse_archive(*src_, path.string(), opt)) {}
  /// An archive image in memory (kept by the caller while the reader lives).
  ArchiveReader(const uint8_t* data, std::size_t size, const std::string& name = "<memory>",
                const ArchiveReadOptions& opt = {})
      : src_(make_mem(data, size, name)), info_(detail::parse_archive(*src_, name, opt)) {}

  const ArchiveInfo& info() const { return info_; }

  /// Checks every byte: each record against the index, its payload CRC and padding, restored
  /// rows against the cache's rules, and the whole-file CRC. Throws kIo naming what is wrong.
  void verify() const { detail::verify_all(*src_, info_); }

  /// The whole cache (every byte verified, whole-file CRC included).
  KVCache load() const { return detail::load_cache(*src_, info_, {}, true); }
  /// Some layers and/or a token prefix: reads and verifies only the records they need (the
  /// whole-file CRC is not computed). The result equals load() followed by truncate(tokens)
  /// of the selected layers, with the other layers empty.
  KVCache load(const ArchiveSelection& sel) const {
    return detail::load_cache(*src_, info_, sel, false);
  }
  /// Loads into `into`, whose policy (every config field) and shape must be the archive's
  /// (kInvalidArgument / kShapeMismatch otherwise, naming both). `into` keeps its options and
  /// max_tokens (the archive's tokens must fit); on any error it is left unchanged.
  void load_into(KVCache& into) const {
    check_compatible(into.policy(), into.n_layers(), into.kv_heads(), into.head_dim());
    for (int l = 0; l < info_.n_layers; ++l)
      KVQ_REQUIRE(into.max_tokens() == 0 || info_.layers[static_cast<std::size_t>(l)].tokens <= into.max_tokens(),
                  kOutOfRange, info_.source, ": layer ", l, " holds ",
                  info_.layers[static_cast<std::size_t>(l)].tokens, " tokens, beyond the cache's max_tokens=",
                  into.max_tokens());
    ArchiveInfo adj = info_;
    adj.options = into.options();
    adj.max_tokens = into.max_tokens();
    KVCache c = detail::load_cache(*src_, adj, {}, true);
    into = std::move(c);
  }

  /// Throws unless the archive holds a cache of this policy and shape.
  void check_compatible(const Policy& policy, int n_layers, int kv_heads, int head_dim) const {
    KVQ_REQUIRE(n_layers == info_.n_layers && kv_heads == info_.kv_heads && head_dim == info_.head_dim,
                kShapeMismatch, info_.source, ": the archive holds ", info_.n_layers, " layers of ",
                info_.kv_heads, " kv heads x head_dim ", info_.head_dim, ", the cache ", n_layers,
                " layers of ", kv_heads, " x ", head_dim);
    if (policy == info_.policy) return;
    const std::string a = info_.policy.spec(), b = policy.spec();
    fail(ErrorKind::kInvalidArgument, info_.source, ": the archive was written under policy '", a,
         "' but the cache's policy is '", b, "'",
         a == b ? " (same spec; they differ in a seed, an fp8 margin or a nuq codebook)" : "");
  }

  /// Dequantizes tokens [begin, end) of `layer` into k_out and v_out ([end - begin, kv_heads,
  /// head_dim], any strides), reading (and verifying) only the records that overlap the range.
  void read(int layer, int64_t begin, int64_t end, KVView<float> k_out, KVView<float> v_out) const {
    KVQ_REQUIRE(layer >= 0 && layer < info_.n_layers, kInvalidArgument, info_.source, ": layer ", layer,
                " does not exist (the archive has ", info_.n_layers, " layers)");
    const ArchiveLayer& A = info_.layers[static_cast<std::size_t>(layer)];
    KVQ_REQUIRE(0 <= begin && begin <= end && end <= A.tokens, kOutOfRange, info_.source,
                ": range [", begin, ", ", end, ") is outside the ", A.tokens, " tokens of layer ", layer);
    const Shape want{end - begin, info_.kv_heads, info_.head_dim};
    KVQ_REQUIRE(k_out.shape() == want && v_out.shape() == want, kShapeMismatch,
                "ArchiveReader::read: outputs must be ", want.str(), ", got keys ", k_out.shape().str(),
                " and values ", v_out.shape().str());
    const int64_t H = info_.kv_heads, D = info_.head_dim;
    PageArena page(A.layout.bytes);
    std::vector<float> rows;
    std::vector<uint8_t> scratch;
    QuantWorkspace ws;
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info_.records[ri];
      if (r.kind == RecordKind::kRollback) continue;
      const int64_t a = std::max(begin, r.begin), b = std::min(end, r.end);
      if (a >= b) continue;
      const KVView<float> ko = k_out.slice_tokens(a - begin, b - a), vo = v_out.slice_tokens(a - begin, b - a);
      if (r.kind == RecordKind::kPage) {
        page.reserve(1);
        detail::read_record(*src_, info_, r, page.page(0), 0, scratch);
        dequantize_tokens(A.layout.key_view(page.page(0)), a - r.begin, ko, ws);
        dequantize_tokens(A.layout.value_view(page.page(0)), a - r.begin, vo, ws);
        continue;
      }
      rows.resize(static_cast<std::size_t>(r.payload_bytes / 4));
      detail::read_record(*src_, info_, r, rows.data(), 0, scratch);
      const int64_t n = r.end - r.begin;
      detail::check_layer_rows(info_, layer, r, rows, n, r.kind != RecordKind::kSinks);
      const auto kv = KVView<const float>::nhd(rows.data(), n, H, D);
      const auto vv = KVView<const float>::nhd(rows.data() + n * H * D, n, H, D);
      for (int64_t t = a; t < b; ++t)
        for (int64_t h = 0; h < H; ++h) {
          ::kvq::detail::store_row(ko, t - a, h, kv.row(t - r.begin, h));
          ::kvq::detail::store_row(vo, t - a, h, vv.row(t - r.begin, h));
        }
    }
  }

 private:
  static std::unique_ptr<detail::Source> make_mem(const uint8_t* data, std::size_t size,
                                                  const std::string& name) {
    KVQ_REQUIRE(data != nullptr || size == 0, kInvalidArgument, name, ": null buffer");
    static const uint8_t empty = 0;
    return std::make_unique<detail::MemorySource>(data ? data : &empty, size);
  }

  std::unique_ptr<detail::Source> src_;
  ArchiveInfo info_;
};

}  // namespace io
}  // namespace kvq
