// kvq_oracle: the C++ side of the Python binding's equality tests. It runs the same headers the
// module wraps on inputs the tests write as raw float32 files, and writes what it gets (packed
// buffers, accountant figures, cache contents, attention outputs, error messages) for pytest to
// compare byte for byte. Compiled by python/tests/conftest.py with the SIMD flags of the module
// variant under test.
//
//   kvq_oracle quantize TERM T H D IN.f32 OUTPREFIX    -> OUTPREFIX.<buffer> files; prints
//                                                         "nbytes N" and "effective_bits X"
//   kvq_oracle account TERM T H D                      -> "nbytes N" and "effective_bits X"
//   kvq_oracle policy SPEC                             -> the canonical spec
//   kvq_oracle cache SPEC L H D T K.f32 V.f32 Q.f32 QH NQ OUTPREFIX
//        appends layer l = K[l] ([T, H, D] each, L layers back to back) in two chunks
//        (T/3 then the rest), writes OUTPREFIX.k<l>/.v<l> (read back, f32) and OUTPREFIX.a<l>
//        (attention of the last NQ queries of Q[l], [NQ, QH, D]); prints the memory report's
//        total, effective bits and per-kind byte counts
//   kvq_oracle calibrate SPEC DUMP PREROPE(0|1) WEIGHTS(sensitivity|uniform) OUT.json
//        calibrates SPEC's nuq codebooks on the KV dump DUMP and writes the calibration file
// On kvq::Error it prints "error <message>" and exits 3.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"

namespace {

std::vector<float> read_f32(const std::string& path, size_t n) {
  std::ifstream f(path, std::ios::binary);
  std::vector<float> v(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  if (!f) {
    std::fprintf(stderr, "kvq_oracle: cannot read %zu floats from %s\n", n, path.c_str());
    std::exit(2);
  }
  return v;
}

void write_bytes(const std::string& path, const void* p, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
}

int64_t num(const char* s) { return std::strtoll(s, nullptr, 10); }

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "quantize" && argc == 8) {
    const kvq::QuantConfig cfg = kvq::parse_quant_config(argv[2]);
    const kvq::Shape s{num(argv[3]), num(argv[4]), num(argv[5])};
    const std::vector<float> x = read_f32(argv[6], static_cast<size_t>(s.numel()));
    const kvq::QTensor q = kvq::quantize(cfg, kvq::KVView<const float>(x.data(), s));
    const std::string out = argv[7];
    write_bytes(out + ".codes", q.codes.data(), q.codes.size());
    write_bytes(out + ".scales", q.scales.raw().data(), q.scales.bytes());
    write_bytes(out + ".zeros", q.zeros.raw().data(), q.zeros.bytes());
    write_bytes(out + ".norms", q.norms.raw().data(), q.norms.bytes());
    write_bytes(out + ".qjl_signs", q.qjl_signs.data(), q.qjl_signs.size());
    write_bytes(out + ".qjl_norms", q.qjl_norms.raw().data(), q.qjl_norms.bytes());
    write_bytes(out + ".outlier_values", q.outlier_values.data(), q.outlier_values.size());
    write_bytes(out + ".outlier_pos", q.outlier_pos.data(), q.outlier_pos.size());
    std::printf("nbytes %zu\neffective_bits %.17g\n", q.bytes(), q.effective_bits());
    return 0;
  }
  if (mode == "calibrate" && argc == 7) {
    const kvq::Policy p = kvq::parse_policy(argv[2]);
    const kvq::io::KVDump dump = kvq::io::load_kv_dump(argv[3]);
    kvq::CalibrationOptions opt;
    const bool uniform = std::string(argv[5]) == "uniform";
    opt.weights = uniform ? kvq::CalibrationWeights::kUniform : kvq::CalibrationWeights::kSensitivity;
    const kvq::Policy c = kvq::calibrate(p, dump, std::string(argv[4]) == "1", opt);
    kvq::save_calibration(argv[6], c, static_cast<int>(dump.num_layers()), "",
                          opt.weights);
    return 0;
  }
  if (mode == "account" && argc == 6) {
    const kvq::QuantConfig cfg = kvq::parse_quant_config(argv[2]);
    const kvq::Shape s{num(argv[3]), num(argv[4]), num(argv[5])};
    std::printf("nbytes %zu\neffective_bits %.17g\n", kvq::account(cfg, s).total(),
                kvq::effective_bits(cfg, s));
    return 0;
  }
  if (mode == "policy" && argc == 3) {
    std::printf("%s\n", kvq::parse_policy(argv[2]).spec().c_str());
    return 0;
  }
  if (mode == "cache" && argc == 13) {
    const kvq::Policy p = kvq::parse_policy(argv[2]);
    const int L = static_cast<int>(num(argv[3])), H = static_cast<int>(num(argv[4])),
              D = static_cast<int>(num(argv[5]));
    const int64_t T = num(argv[6]);
    const int QH = static_cast<int>(num(argv[10]));
    const int64_t NQ = num(argv[11]);
    const std::string out = argv[12];
    const size_t per = static_cast<size_t>(T * H * D);
    const std::vector<float> K = read_f32(argv[7], per * L), V = read_f32(argv[8], per * L);
    const std::vector<float> Q = read_f32(argv[9], static_cast<size_t>(T * QH * D) * L);
    kvq::KVCache cache(p, L, H, D);
    const kvq::Shape s{T, H, D};
    for (int l = 0; l < L; ++l) {
      const kvq::KVView<const float> k(K.data() + per * l, s), v(V.data() + per * l, s);
      const int64_t first = T / 3;
      cache.append(l, k.slice_tokens(0, first), v.slice_tokens(0, first));
      cache.append(l, k.slice_tokens(first, T - first), v.slice_tokens(first, T - first));
      std::vector<float> kr(per), vr(per);
      cache.read(l, 0, T, kvq::KVView<float>(kr.data(), s), kvq::KVView<float>(vr.data(), s));
      write_bytes(out + ".k" + std::to_string(l), kr.data(), per * sizeof(float));
      write_bytes(out + ".v" + std::to_string(l), vr.data(), per * sizeof(float));
      const float* q = Q.data() + static_cast<size_t>(T * QH * D) * l +
                       static_cast<size_t>((T - NQ) * QH * D);
      std::vector<float> o(static_cast<size_t>(NQ * QH * D));
      kvq::attend(cache, l, kvq::KVView<const float>(q, kvq::Shape{NQ, QH, D}),
                  kvq::KVView<float>(o.data(), kvq::Shape{NQ, QH, D}), true);
      write_bytes(out + ".a" + std::to_string(l), o.data(), o.size() * sizeof(float));
    }
    const kvq::MemoryReport r = cache.memory_report();
    std::printf("total %zu\neffective_bits %.17g\nkeys %zu\nvalues %zu\n", r.total(),
                r.effective_bits(), r.key_total().total(), r.value_total().total());
    return 0;
  }
  std::fprintf(stderr, "kvq_oracle: bad arguments (see the file comment)\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const kvq::Error& e) {
    std::printf("error %s\n", e.what());
    return 3;
  }
}
