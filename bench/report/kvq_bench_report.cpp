// kvq_bench_report: turns kvq_bench's JSON output into the table the docs quote: for every
// benchmark the median throughput over its repetitions and its ratio to the median BM_Memcpy of
// the same run, and for the speed targets of the issues whether the ratio meets them.
//
//   kvq_bench --benchmark_repetitions=5 --benchmark_out=bench.json --benchmark_out_format=json
//   kvq_bench_report bench.json
//
// Ratios, not absolute times: the machines kvq is measured on are shared VMs whose bandwidth
// drifts between runs; both sides of a ratio come from the same run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/io/json.hpp"

namespace {

double number(const kvq::io::Json& j) { return std::strtod(j.number_text().c_str(), nullptr); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Target {
  const char* prefix;  // benchmarks whose name starts with this
  double min_ratio;    // ratio to BM_Memcpy that the issue asks for (0: see max_ns)
  double max_ns;       // ns per item ceiling (FWHT), 0 when a ratio target
  const char* source;
};

// The speed targets of the issues (ratio to BM_Memcpy, single thread).
const Target kTargets[] = {
    {"BM_Quantize/int4/token/f32", 0.7, 0, "issue 2"},
    {"BM_Quantize/int8/token/f32", 0.7, 0, "issue 2"},
    {"BM_Quantize/int4/channel/f32", 0.5, 0, "issue 2"},
    {"BM_Quantize/int8/channel/f32", 0.5, 0, "issue 2"},
    {"BM_Dequantize/int", 0.7, 0, "issue 2"},
    {"BM_Fp8Encode/", 0.8, 0, "issue 3"},
    {"BM_Fp8Decode/", 0.8, 0, "issue 3"},
    {"BM_Fwht/128", 0, 20.0, "issue 4"},
    {"BM_Quantize/lm4/rot/f32", 0.3, 0, "issue 4"},
    {"BM_Quantize/nuq3/token/f32", 0.3, 0, "issue 11"},
    {"BM_Quantize/int3/token/out1%/f32", 0.3, 0, "issue 11"},
};

/// The machine the run was measured on (kvq_bench records it in the JSON context).
void print_context(const kvq::io::Json& doc) {
  const kvq::io::Json* ctx = doc.find("context");
  if (!ctx) return;
  auto str = [&](const char* k) -> std::string {
    const kvq::io::Json* v = ctx->find(k);
    if (!v) return "?";
    if (v->is_string()) return v->as_string();
    if (v->is_number()) return v->number_text();
    return "?";
  };
  std::printf("CPU: %s (%s CPUs, %s MHz); SIMD level: %s; flags: %s\n\n", str("cpu_model").c_str(),
              str("num_cpus").c_str(), str("mhz_per_cpu").c_str(), str("kvq_simd").c_str(),
              str("cpu_flags").c_str());
}

// Decode targets (issue 9): at 32768 tokens, single thread.
struct DecodeTarget {
  const char* policy;
  double min_fraction;  // of BM_StreamRead over the same bytes (0: none)
  double min_speedup;   // over f16 decode (0: none)
};
const DecodeTarget kDecodeTargets[] = {
    {"f16", 0.6, 0}, {"fp8", 0.45, 1.6}, {"k8v4", 0.45, 0}, {"kivi4", 0.35, 2.5}};
constexpr const char* kTargetTokens = "32768";

/// BM_Decode/<policy>/<tokens>: tokens/s, KV bytes/s, fraction of the same run's
/// BM_StreamRead/<kv_bytes>, speedup over BM_Decode/f16/<tokens> and, when the run has
/// BM_FmaPeak, the fraction of that compute ceiling (tokens/s x fma_per_token / FMAs/s). Under
/// the table, what each target would need of the ceiling. Returns targets missed.
int decode_table(std::map<std::string, std::vector<double>>& bps,
                 std::map<std::string, std::vector<double>>& ips,
                 std::map<std::string, std::vector<double>>& kvb,
                 std::map<std::string, std::vector<double>>& fpt) {
  std::vector<std::string> names;
  for (const auto& kv : ips)
    if (kv.first.rfind("BM_Decode/", 0) == 0) names.push_back(kv.first);
  if (names.empty()) return 0;
  const double peak = ips.count("BM_FmaPeak") ? median(ips["BM_FmaPeak"]) : 0;
  std::printf("| decode | tokens/s | KV read | fraction of BM_StreamRead (same bytes) | speedup "
              "vs f16 | fraction of BM_FmaPeak | target |\n|---|---|---|---|---|---|---|\n");
  std::vector<std::string> needs;  // per target: the fraction of the FMA ceiling it implies
  int missed = 0, no_stream = 0;
  for (const std::string& n : names) {
    const std::string rest = n.substr(10);
    const auto slash = rest.find('/');
    if (slash == std::string::npos) continue;
    const std::string policy = rest.substr(0, slash), tokens = rest.substr(slash + 1);
    const double tps = median(ips[n]);
    const double bw = bps.count(n) ? median(bps[n]) : 0;
    double frac = -1, speed = -1;
    if (kvb.count(n)) {
      char sr[64];
      std::snprintf(sr, sizeof sr, "BM_StreamRead/%.0f", median(kvb[n]));
      if (bps.count(sr)) {
        frac = bw / median(bps[sr]);
      } else {
        ++no_stream;
      }
    }
    const std::string f16 = "BM_Decode/f16/" + tokens;
    if (ips.count(f16)) speed = tps / median(ips[f16]);
    // FMAs per second at a given tokens/s, as a fraction of the ceiling (-1: unknown).
    const double per_token = fpt.count(n) ? median(fpt[n]) : 0;
    auto of_peak = [&](double tokens_per_s) {
      return peak > 0 && per_token > 0 ? tokens_per_s * per_token / peak : -1.0;
    };
    auto need = [&](const char* what, double tokens_per_s) {
      const double f = of_peak(tokens_per_s);
      if (f < 0) return;
      char buf[200];
      std::snprintf(buf, sizeof buf, "%s %s needs %.0f tokens/s = %.2f of BM_FmaPeak%s",
                    policy.c_str(), what, tokens_per_s, f,
                    f > 1 ? " (above the ceiling)" : "");
      needs.push_back(buf);
    };
    std::string target;
    if (tokens == kTargetTokens) {
      for (const DecodeTarget& t : kDecodeTargets) {
        if (policy != t.policy) continue;
        char buf[96];
        if (t.min_fraction > 0) {
          const bool ok = frac >= t.min_fraction;
          std::snprintf(buf, sizeof buf, "fraction >= %.2f %s", t.min_fraction, ok ? "met" : "MISSED");
          target += buf;
          missed += ok ? 0 : 1;
          if (frac > 0) {
            std::snprintf(buf, sizeof buf, "fraction >= %.2f", t.min_fraction);
            need(buf, tps * t.min_fraction / frac);
          }
        }
        if (t.min_speedup > 0) {
          const bool ok = speed >= t.min_speedup;
          std::snprintf(buf, sizeof buf, "%sspeedup >= %.1fx %s", target.empty() ? "" : "; ",
                        t.min_speedup, ok ? "met" : "MISSED");
          target += buf;
          missed += ok ? 0 : 1;
          if (speed > 0) {
            std::snprintf(buf, sizeof buf, "speedup >= %.1fx", t.min_speedup);
            need(buf, tps * t.min_speedup / speed);
          }
        }
      }
    }
    char fb[32] = "?", sb[32] = "?", pb[32] = "?";
    if (frac >= 0) std::snprintf(fb, sizeof fb, "%.2f", frac);
    if (speed >= 0) std::snprintf(sb, sizeof sb, "%.2fx", speed);
    if (of_peak(tps) >= 0) std::snprintf(pb, sizeof pb, "%.2f", of_peak(tps));
    std::printf("| %s | %.0f | %.2f GB/s | %s | %s | %s | %s |\n", n.c_str(), tps, bw / 1e9, fb, sb,
                pb, target.c_str());
  }
  std::printf("\n");
  if (peak > 0) {
    std::printf("BM_FmaPeak (one thread, fp32 FMAs at the build's SIMD width): %.3g FMA/s. Every "
                "decode does fma_per_token FMAs per cached token at any storage format, so a "
                "target needing more than 1.0 of it cannot be met by fp32 arithmetic:\n",
                peak);
    for (const std::string& l : needs) std::printf("  %s\n", l.c_str());
    std::printf("\n");
  }
  if (no_stream > 0)
    std::printf("%d decode benchmark(s) have no BM_StreamRead of their byte count in this run "
                "(fraction \"?\"); run the stream reads too, e.g.\n  kvq_bench "
                "--benchmark_filter='BM_(StreamRead/|Decode/.*/32768)' ...\n\n",
                no_stream);
  return missed;
}

/// BM_DecodeBatch/<policy>/<seqs>x<tokens>/threads:<n>: cached tokens/s at each thread count
/// and the scaling over one thread; .../pool:2 (2 workers of a kvq::WorkerPool) in two more
/// columns when the run has them. Targets (issue 30): 2 threads >= 1.8x one thread for the
/// 16x2048 batch and for one 32768-token sequence (1x32768). Returns targets missed.
int batch_table(std::map<std::string, std::vector<double>>& ips,
                std::map<std::string, std::vector<double>>& bps) {
  // <prefix>.../threads:<n>[/real_time] -> n -> median of `m`
  auto by_threads = [](const std::map<std::string, std::vector<double>>& m, const char* prefix) {
    std::map<int, double> r;
    for (const auto& kv : m) {
      const std::string& n = kv.first;
      const auto at = n.find("/threads:");
      if (n.rfind(prefix, 0) == 0 && at != std::string::npos)
        r[std::atoi(n.c_str() + at + 9)] = median(kv.second);
    }
    return r;
  };
  // the bandwidth and the fp32 FMA rate n workers reach at once
  std::map<int, double> stream = by_threads(bps, "BM_StreamRead/");
  std::map<int, double> fma = by_threads(ips, "BM_FmaPeak/");
  if (stream.count(1) && stream.count(2))
    std::printf("Memory bandwidth two workers share: BM_StreamRead on 2 threads at once %.2f GB/s, "
                "1 thread %.2f GB/s: %.2fx (a kernel bound by its bytes scales no further)\n",
                stream[2] / 1e9, stream[1] / 1e9, stream[2] / stream[1]);
  if (fma.count(1) && fma.count(2))
    std::printf("Compute two workers share: BM_FmaPeak on 2 threads at once %.3g FMA/s, 1 thread "
                "%.3g FMA/s: %.2fx (a kernel bound by its FMAs scales this far)\n",
                fma[2], fma[1], fma[2] / fma[1]);
  if ((stream.count(1) && stream.count(2)) || (fma.count(1) && fma.count(2))) std::printf("\n");
  // "<policy>/<shape>" -> threads -> median tokens/s
  std::map<std::string, std::map<int, double>> rows;
  // "<policy>/<shape>" -> median tokens/s with 2 workers of a kvq::WorkerPool (".../pool:2")
  std::map<std::string, double> pool2;
  for (const auto& kv : ips) {
    const std::string& n = kv.first;
    if (n.rfind("BM_DecodeBatch/", 0) != 0) continue;
    const auto pat = n.rfind("/pool:2");
    if (pat != std::string::npos) {
      pool2[n.substr(15, pat - 15)] = median(kv.second);
      continue;
    }
    const auto at = n.rfind("/threads:");
    if (at == std::string::npos) continue;
    rows[n.substr(15, at - 15)][std::atoi(n.c_str() + at + 9)] = median(kv.second);
  }
  if (rows.empty()) return 0;
  int most = 1;
  for (const auto& r : rows)
    for (const auto& t : r.second) most = std::max(most, t.first);
  std::printf("| batch decode | tokens/s at 1 thread |");
  for (int t = 2; t <= most; ++t) std::printf(" %d threads | scaling |", t);
  const bool pools = !pool2.empty();
  if (pools) std::printf(" 2 workers, WorkerPool | scaling |");
  std::printf(" target |\n|---|---|");
  for (int t = 2; t <= most; ++t) std::printf("---|---|");
  if (pools) std::printf("---|---|");
  std::printf("---|\n");
  int missed = 0;
  for (const auto& r : rows) {
    const auto one = r.second.find(1);
    std::printf("| %s | %s |", r.first.c_str(),
                one != r.second.end() ? std::to_string(static_cast<long long>(one->second)).c_str() : "?");
    double two = -1;
    for (int t = 2; t <= most; ++t) {
      const auto it = r.second.find(t);
      if (it == r.second.end() || one == r.second.end()) {
        std::printf(" ? | ? |");
        continue;
      }
      const double sc = it->second / one->second;
      if (t == 2) two = sc;
      // two decimals rounded down, so that a miss by less than 0.005 does not print as 1.80x
      std::printf(" %lld | %.2fx |", static_cast<long long>(it->second),
                  std::floor(sc * 100 + 1e-9) / 100);
    }
    if (pools) {
      const auto it = pool2.find(r.first);
      if (it == pool2.end() || one == r.second.end())
        std::printf(" ? | ? |");
      else
        std::printf(" %lld | %.2fx |", static_cast<long long>(it->second),
                    std::floor(it->second / one->second * 100 + 1e-9) / 100);
    }
    std::string target;
    const std::string shape = r.first.substr(r.first.find('/') + 1);
    if (shape == "16x2048" || shape == "1x32768") {
      const bool ok = two >= 1.8;
      if (!ok) ++missed;
      target = std::string("2 threads >= 1.8x ") + (ok ? "ok" : "MISSED");
    }
    std::printf(" %s |\n", target.c_str());
  }
  std::printf("\n");
  return missed;
}

/// BM_Decode/<policy>/<tokens>/fast (the int8 dot-product path) next to BM_Decode/<policy>/
/// <tokens> (exact): both medians, their ratio, and the int8 path over the exact f16 decode of
/// the same length. Targets (issue 30, one thread, 32768 tokens): kivi4 >= 2.5x f16, k8v4 and
/// fp8 >= 2.0x f16. Returns targets missed.
int fast_table(std::map<std::string, std::vector<double>>& ips) {
  struct Row {
    std::string policy, tokens;
    double exact = -1, fast = -1, f16 = -1;
  };
  std::vector<Row> rows;
  for (const auto& kv : ips) {
    const std::string& n = kv.first;
    const std::string suffix = "/fast";
    if (n.rfind("BM_Decode/", 0) != 0 || n.size() <= suffix.size() ||
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string base = n.substr(0, n.size() - suffix.size());  // BM_Decode/<p>/<t>
    const auto slash = base.rfind('/');
    Row r;
    r.policy = base.substr(10, slash - 10);
    r.tokens = base.substr(slash + 1);
    r.fast = median(kv.second);
    if (ips.count(base)) r.exact = median(ips[base]);
    const std::string f16 = "BM_Decode/f16/" + r.tokens;
    if (ips.count(f16)) r.f16 = median(ips[f16]);
    rows.push_back(r);
  }
  if (rows.empty()) return 0;
  std::printf("| int8 path | exact tokens/s | int8 tokens/s | int8 / exact | int8 vs exact f16 | "
              "target |\n|---|---|---|---|---|---|\n");
  int missed = 0;
  auto num = [](double x) {
    return x > 0 ? std::to_string(static_cast<long long>(x)) : std::string("?");
  };
  auto ratio = [](double a, double b) {
    char buf[32];
    if (a > 0 && b > 0) {
      std::snprintf(buf, sizeof buf, "%.2fx", a / b);
      return std::string(buf);
    }
    return std::string("?");
  };
  for (const Row& r : rows) {
    double need = 0;
    if (r.tokens == "32768") {
      if (r.policy == "kivi4") need = 2.5;
      if (r.policy == "k8v4" || r.policy == "fp8") need = 2.0;
    }
    std::string target;
    if (need > 0) {
      const bool ok = r.f16 > 0 && r.fast / r.f16 >= need;
      if (!ok) ++missed;
      char buf[64];
      std::snprintf(buf, sizeof buf, "vs f16 >= %.1fx %s", need, ok ? "ok" : "MISSED");
      target = buf;
    }
    std::printf("| %s/%s | %s | %s | %s | %s | %s |\n", r.policy.c_str(), r.tokens.c_str(),
                num(r.exact).c_str(), num(r.fast).c_str(), ratio(r.fast, r.exact).c_str(),
                ratio(r.fast, r.f16).c_str(), target.c_str());
  }
  std::printf("\n");
  return missed;
}

}  // namespace

int main(int argc, char** argv) {
  // kvq_bench_report [--check] BENCH.json: --check exits 3 when any target is missed.
  bool check = false;
  const char* path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      check = true;
    } else if (a == "-h" || a == "--help" || path != nullptr || a.rfind("--", 0) == 0) {
      path = nullptr;
      argc = 0;
      break;
    } else {
      path = argv[i];
    }
  }
  if (path == nullptr) {
    std::fprintf(stderr,
                 "usage: kvq_bench_report [--check] BENCH.json   (kvq_bench --benchmark_out=...)\n"
                 "  --check  exit with status 3 when any speed target is missed\n");
    return 2;
  }
  try {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot open ") + path);
    std::stringstream ss;
    ss << in.rdbuf();
    const kvq::io::Json doc = kvq::io::parse_json(ss.str(), path);
    const kvq::io::Json* list = doc.find("benchmarks");
    if (!list || !list->is_array()) throw std::runtime_error("no \"benchmarks\" array in the file");
    // name -> per-repetition bytes/s (or items/s) and ns per item
    std::map<std::string, std::vector<double>> bps, ips, kvb, fpt;
    std::vector<std::string> order;
    for (const kvq::io::Json& b : list->items()) {
      const kvq::io::Json* rt = b.find("run_type");
      if (rt && rt->is_string() && rt->as_string() != "iteration") continue;  // skip aggregates
      const kvq::io::Json* name = b.find("run_name");
      if (!name) name = b.find("name");
      if (!name || !name->is_string()) continue;
      const std::string n = name->as_string();
      if (!bps.count(n) && !ips.count(n)) order.push_back(n);
      if (const kvq::io::Json* v = b.find("bytes_per_second"); v && v->is_number())
        bps[n].push_back(number(*v));
      if (const kvq::io::Json* v = b.find("items_per_second"); v && v->is_number()) {
        double rate = number(*v);
        // Google Benchmark divides by the calling thread's CPU time; BM_DecodeBatch's workers
        // run on threads of their own, and a caller waiting for them at the end of a step is not
        // charged, so its rate is turned into one per wall-clock second
        const kvq::io::Json* cpu = b.find("cpu_time");
        const kvq::io::Json* real = b.find("real_time");
        if (n.rfind("BM_DecodeBatch/", 0) == 0 && cpu && real && cpu->is_number() &&
            real->is_number() && number(*real) > 0)
          rate *= number(*cpu) / number(*real);
        ips[n].push_back(rate);
      }
      if (const kvq::io::Json* v = b.find("kv_bytes"); v && v->is_number())
        kvb[n].push_back(number(*v));
      if (const kvq::io::Json* v = b.find("fma_per_token"); v && v->is_number())
        fpt[n].push_back(number(*v));
    }
    print_context(doc);
    int missed = decode_table(bps, ips, kvb, fpt);
    missed += batch_table(ips, bps);
    missed += fast_table(ips);
    if (!bps.count("BM_Memcpy")) {
      // a decode-only run (BM_Decode + BM_StreamRead) has its table above; the other targets
      // are ratios to BM_Memcpy
      bool other = false;
      for (const std::string& n : order)
        other = other || (n.rfind("BM_Decode/", 0) != 0 && n.rfind("BM_StreamRead/", 0) != 0 &&
                          n.rfind("BM_DecodeBatch/", 0) != 0 && n.rfind("BM_FmaPeak", 0) != 0);
      if (other || order.empty())
        throw std::runtime_error("the run has no BM_Memcpy (the ratios below are to it)");
      std::printf("(no BM_Memcpy in this run: only the decode tables)\n\n%d target(s) missed\n",
                  missed);
      return check && missed > 0 ? 3 : 0;
    }
    const double memcpy_bps = median(bps["BM_Memcpy"]);
    const size_t reps = bps["BM_Memcpy"].size();
    std::printf("BM_Memcpy median %.2f GB/s over %zu repetition(s); ratios are medians / that\n\n",
                memcpy_bps / 1e9, reps);
    std::printf("| benchmark | median | ratio to BM_Memcpy | target |\n|---|---|---|---|\n");
    for (const std::string& n : order) {
      std::string value, ratio = "", target = "";
      double r = 0, ns = 0;
      if (!bps.count(n) && !ips.count(n)) continue;
      char buf[64];
      if (bps.count(n)) {
        const double m = median(bps[n]);
        r = m / memcpy_bps;
        std::snprintf(buf, sizeof buf, "%.2f GB/s", m / 1e9);
        value = buf;
        std::snprintf(buf, sizeof buf, "%.2fx", r);
        ratio = buf;
      }
      if (ips.count(n)) {  // items (vectors) per second: also ns per item
        ns = 1e9 / median(ips[n]);
        std::snprintf(buf, sizeof buf, "%s%.1f ns/item", value.empty() ? "" : ", ", ns);
        value += buf;
      }
      for (const Target& t : kTargets) {
        if (n.rfind(t.prefix, 0) != 0) continue;
        char buf[96];
        const bool ok = t.max_ns > 0 ? (ns > 0 && ns <= t.max_ns) : r >= t.min_ratio;
        if (t.max_ns > 0) {
          std::snprintf(buf, sizeof buf, "<= %.0f ns (%s) %s", t.max_ns, t.source, ok ? "met" : "MISSED");
        } else {
          std::snprintf(buf, sizeof buf, ">= %.1fx (%s) %s", t.min_ratio, t.source, ok ? "met" : "MISSED");
        }
        target = buf;
        missed += ok ? 0 : 1;
        break;
      }
      std::printf("| %s | %s | %s | %s |\n", n.c_str(), value.c_str(), ratio.c_str(), target.c_str());
    }
    std::printf("\n%d target(s) missed\n", missed);
    return check && missed > 0 ? 3 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_report: %s\n", e.what());
    return 1;
  }
}
