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
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fprintf(stderr, "usage: kvq_bench_report BENCH.json   (kvq_bench --benchmark_out=...)\n");
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot open ") + argv[1]);
    std::stringstream ss;
    ss << in.rdbuf();
    const kvq::io::Json doc = kvq::io::parse_json(ss.str(), argv[1]);
    const kvq::io::Json* list = doc.find("benchmarks");
    if (!list || !list->is_array()) throw std::runtime_error("no \"benchmarks\" array in the file");
    // name -> per-repetition bytes/s (or items/s) and ns per item
    std::map<std::string, std::vector<double>> bps, ips;
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
      if (const kvq::io::Json* v = b.find("items_per_second"); v && v->is_number())
        ips[n].push_back(number(*v));
    }
    if (!bps.count("BM_Memcpy")) throw std::runtime_error("the run has no BM_Memcpy");
    const double memcpy_bps = median(bps["BM_Memcpy"]);
    const size_t reps = bps["BM_Memcpy"].size();
    std::printf("BM_Memcpy median %.2f GB/s over %zu repetition(s); ratios are medians / that\n\n",
                memcpy_bps / 1e9, reps);
    std::printf("| benchmark | median | ratio to BM_Memcpy | target |\n|---|---|---|---|\n");
    int missed = 0;
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
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_report: %s\n", e.what());
    return 1;
  }
}
