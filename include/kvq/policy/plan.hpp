#pragma once
/// \file plan.hpp
/// The budget planner's allocation: given, for every (layer, K or V) slot, the damage each
/// candidate scheme would do there and the storage bits it costs, choose one candidate per
/// slot (or per group of slots) so that the summed damage is least while the mean storage
/// bits stay within a budget. The measurement of the damage (real model, calibration text)
/// lives with the tool (examples/kvq_plan.cpp); this header is the pure part that every
/// engine can reuse with its own measurements.
///
/// Storage bits are the accountant's bytes for complete groups (account() on one stream block,
/// metadata included; no residual window, sinks, partial tails or page padding), so a budget
/// means the same on short and long sequences. Every slot holds the same number of values
/// (a layer's keys and values are both tokens x kv_heads x head_dim), so the mean over slots
/// is the mean over values.
///
/// The search is exact: a multiple-choice knapsack solved by dynamic programming over the
/// budget in units of 1/kPlanBitUnits bit (each candidate's cost rounded up, so a plan never
/// exceeds its budget). Granularities tie slots together: `model` gives all keys one scheme
/// and all values one scheme, `layer` gives a layer's keys and values the same candidate,
/// `layer-kv` chooses every slot on its own.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/core/error.hpp"
#include "kvq/policy/calibrate.hpp"
#include "kvq/policy/spec.hpp"

namespace kvq {

/// A scheme the planner may choose: the key and value configs it stores (a candidate is used
/// for keys, values or both, depending on the slot).
struct PlanCandidate {
  std::string name;  ///< as given (a spec or preset name)
  QuantConfig key = raw_config(Format::kF16);
  QuantConfig value = raw_config(Format::kF16);
  /// Per-layer configs (key, value) when they differ by layer: nuq candidates carry each
  /// layer's calibrated codebook here (calibrate_plan_candidates). Empty: key and value on
  /// every layer.
  std::vector<std::pair<QuantConfig, QuantConfig>> per_layer;

  /// True when the candidate stores keys or values as nuq (needs per-layer codebooks).
  bool needs_codebooks() const { return key.format == Format::kNuq || value.format == Format::kNuq; }
  /// The key / value config of layer l (the calibrated one when per_layer is set).
  const QuantConfig& key_at(int l) const {
    return per_layer.empty() ? key : per_layer.at(static_cast<size_t>(l)).first;
  }
  const QuantConfig& value_at(int l) const {
    return per_layer.empty() ? value : per_layer.at(static_cast<size_t>(l)).second;
  }
};

/// How slots are tied together (docs/policy.md, "The budget planner").
enum class PlanGranularity { kModel, kLayer, kLayerKV };

inline const char* granularity_name(PlanGranularity g) {
  switch (g) {
    case PlanGranularity::kModel: return "model";
    case PlanGranularity::kLayer: return "layer";
    case PlanGranularity::kLayerKV: return "layer-kv";
  }
  return "?";
}

/// "model" | "layer" | "layer-kv"; anything else (including "head": kvq's policies have no
/// per-head terms) is an error naming the word.
inline PlanGranularity parse_granularity(const std::string& s) {
  if (s == "model") return PlanGranularity::kModel;
  if (s == "layer") return PlanGranularity::kLayer;
  if (s == "layer-kv") return PlanGranularity::kLayerKV;
  if (s == "head")
    fail(ErrorKind::kUnsupported, "granularity 'head' is not supported: kvq policies choose a "
                                  "scheme per layer and K/V, not per kv head (use layer-kv)");
  fail(ErrorKind::kInvalidArgument, "unknown granularity '", s,
       "' (expected model, layer or layer-kv)");
}

/// Candidates from a ';'-separated list of `[name=]spec` items, each spec one key term and one
/// value term (a policy spec or preset without skip or per-layer overrides; its residual and
/// sinks are ignored: plans store every complete group). nuq candidates need their per-layer
/// codebooks before they are measured or used (calibrate_plan_candidates). Errors name the
/// item.
inline std::vector<PlanCandidate> parse_plan_candidates(const std::string& list) {
  std::vector<PlanCandidate> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t end = std::min(list.find(';', pos), list.size());
    const std::string item(detail::trim(std::string_view(list).substr(pos, end - pos)));
    pos = end + 1;
    if (item.empty()) continue;
    std::string name = item, spec = item;
    const auto eq = item.find('=');
    const std::string head = eq == std::string::npos ? std::string() : item.substr(0, eq);
    const bool is_field = head == "k" || head == "v" || head == "residual" || head == "sinks" ||
                          head == "skip" || head == "skipas" ||
                          head.find_first_of(",@") != std::string::npos;
    if (eq != std::string::npos && !is_field) {  // name=spec
      name = item.substr(0, eq);
      spec = item.substr(eq + 1);
    }
    Policy p;
    try {
      p = parse_policy(spec);
    } catch (const Error& e) {
      fail(ErrorKind::kInvalidArgument, "candidate '", item, "': ", e.what());
    }
    KVQ_REQUIRE(p.overrides.empty() && p.skip_first == 0 && p.skip_last == 0, kInvalidArgument,
                "candidate '", item, "' must be one key term and one value term (no skip, no "
                "per-layer overrides)");
    for (const auto& c : out)
      KVQ_REQUIRE(c.name != name, kInvalidArgument, "candidate name '", name, "' appears twice");
    out.push_back({name, p.key, p.value, {}});
  }
  KVQ_REQUIRE(!out.empty(), kInvalidArgument, "plan: the candidate list is empty");
  return out;
}

/// The default candidates: integers of 2, 3, 4 and 8 bits (keys per channel, values per
/// token, groups of 32: KIVI's geometry), nuq of 2, 3 and 4 bits in the same geometry, plain
/// and with 1% dense-and-sparse outliers (KVQuant; codebooks calibrated per layer on the
/// planner's calibration data), rotated Lloyd-Max of 2, 3 and 4 bits, e4m3 per head and f16.
inline constexpr const char* kDefaultPlanCandidates =
    "int2=k=int2/channel/g32,v=int2/token/g32;"
    "int3=k=int3/channel/g32,v=int3/token/g32;"
    "int4=k=int4/channel/g32,v=int4/token/g32;"
    "int8=k=int8/channel/g32,v=int8/token/g32;"
    "nuq2=k=nuq2/channel/g32,v=nuq2/token/g32;"
    "nuq3=k=nuq3/channel/g32,v=nuq3/token/g32;"
    "nuq4=k=nuq4/channel/g32,v=nuq4/token/g32;"
    "nuq2+1%=k=nuq2/channel/g32/out1%,v=nuq2/token/g32/out1%;"
    "nuq3+1%=k=nuq3/channel/g32/out1%,v=nuq3/token/g32/out1%;"
    "nuq4+1%=k=nuq4/channel/g32/out1%,v=nuq4/token/g32/out1%;"
    "lm2=k=lm2/rot,v=lm2/rot;"
    "lm3=k=lm3/rot,v=lm3/rot;"
    "lm4=k=lm4/rot,v=lm4/rot;"
    "fp8=k=e4m3/head,v=e4m3/head;"
    "f16=k=f16,v=f16";

inline std::vector<PlanCandidate> default_plan_candidates() {
  return parse_plan_candidates(kDefaultPlanCandidates);
}

/// Storage bits per value of `cfg` in a streaming cache of `kv_heads` x `head_dim`: the
/// accountant's bytes of one complete stream block (the config as the cache streams it, the
/// block's token count), metadata included, divided by its values. Per-layer metadata that no
/// block holds (a nuq codebook: 4 x 2^bits bytes per layer; NVFP4's tensor scale) is not in
/// it: it does not grow with the sequence.
inline double storage_bits(const QuantConfig& cfg, int kv_heads, int head_dim) {
  KVQ_REQUIRE(kv_heads > 0 && head_dim > 0, kInvalidArgument, "storage_bits: kv_heads ",
              kv_heads, " and head_dim ", head_dim, " must be positive");
  const QuantConfig s = detail::streaming_config(cfg);
  const int64_t b = detail::stream_block_tokens(s, s);
  const Shape shape{b, kv_heads, head_dim};
  return account(s, shape).effective_bits(shape.numel());
}

/// Budget unit: costs and budgets are counted in 1/kPlanBitUnits bit (costs rounded up).
inline constexpr int kPlanBitUnits = 4096;

/// The planner's input: slots s = 2 * layer + (0 keys, 1 values); for each slot and candidate
/// the damage (any non-negative measure that adds over slots: predicted KL, output error) and
/// the storage bits. Candidates a slot must not use have damage = +infinity.
struct PlanProblem {
  int n_layers = 0;
  std::vector<PlanCandidate> candidates;
  std::vector<std::vector<double>> damage;  ///< [slot][candidate]
  std::vector<std::vector<double>> bits;    ///< [slot][candidate]

  int slots() const { return 2 * n_layers; }
  /// Checks sizes and values; throws kInvalidArgument naming the first bad entry.
  void validate() const {
    KVQ_REQUIRE(n_layers > 0, kInvalidArgument, "plan: n_layers must be positive, got ", n_layers);
    KVQ_REQUIRE(!candidates.empty(), kInvalidArgument, "plan: no candidates");
    KVQ_REQUIRE(damage.size() == static_cast<size_t>(slots()) &&
                    bits.size() == static_cast<size_t>(slots()),
                kInvalidArgument, "plan: need ", slots(), " slots of damage and bits, got ",
                damage.size(), " and ", bits.size());
    for (int s = 0; s < slots(); ++s) {
      const auto& d = damage[static_cast<size_t>(s)];
      const auto& b = bits[static_cast<size_t>(s)];
      KVQ_REQUIRE(d.size() == candidates.size() && b.size() == candidates.size(),
                  kInvalidArgument, "plan: slot ", s, " has ", d.size(), " damages and ",
                  b.size(), " bit costs for ", candidates.size(), " candidates");
      for (size_t c = 0; c < d.size(); ++c) {
        KVQ_REQUIRE(!std::isnan(d[c]) && d[c] >= 0, kInvalidArgument, "plan: slot ", s,
                    " candidate '", candidates[c].name, "' has damage ", d[c],
                    " (need a non-negative number or +inf)");
        KVQ_REQUIRE(std::isfinite(b[c]) && b[c] > 0 && b[c] <= 64, kInvalidArgument,
                    "plan: slot ", s, " candidate '", candidates[c].name, "' costs ", b[c],
                    " bits (need a number in (0, 64])");
      }
    }
  }
};

/// A chosen plan.
struct PlanChoice {
  std::vector<int> choice;        ///< [slot] -> candidate index
  double mean_bits = 0;           ///< mean storage bits over slots (<= the budget)
  double damage = 0;              ///< summed damage of the choice
  PlanGranularity granularity = PlanGranularity::kLayerKV;
  double budget = 0;
};

namespace detail {

/// The groups of slots that share one candidate under `g`.
inline std::vector<std::vector<int>> plan_groups(int n_layers, PlanGranularity g) {
  std::vector<std::vector<int>> groups;
  switch (g) {
    case PlanGranularity::kModel: {
      std::vector<int> k, v;
      for (int l = 0; l < n_layers; ++l) {
        k.push_back(2 * l);
        v.push_back(2 * l + 1);
      }
      groups = {k, v};
      break;
    }
    case PlanGranularity::kLayer:
      for (int l = 0; l < n_layers; ++l) groups.push_back({2 * l, 2 * l + 1});
      break;
    case PlanGranularity::kLayerKV:
      for (int s = 0; s < 2 * n_layers; ++s) groups.push_back({s});
      break;
  }
  return groups;
}

inline int64_t bit_units(double bits) {
  return static_cast<int64_t>(std::ceil(bits * kPlanBitUnits - 1e-6));
}

}  // namespace detail

/// The least-damage choice whose mean storage bits are at most `budget` (exact for the costs
/// rounded up to 1/kPlanBitUnits bit). Ties go to fewer bits, then to the lower candidate
/// index. Throws kInvalidArgument when even the cheapest choice exceeds the budget, naming it.
inline PlanChoice plan_allocate(const PlanProblem& p, double budget, PlanGranularity g) {
  p.validate();
  KVQ_REQUIRE(std::isfinite(budget) && budget > 0, kInvalidArgument,
              "plan: the budget must be a positive number of bits, got ", budget);
  const auto groups = detail::plan_groups(p.n_layers, g);
  const size_t nc = p.candidates.size();
  const double inf = std::numeric_limits<double>::infinity();
  // Per group and candidate: cost in units and damage.
  std::vector<std::vector<int64_t>> cost(groups.size(), std::vector<int64_t>(nc, 0));
  std::vector<std::vector<double>> dmg(groups.size(), std::vector<double>(nc, 0));
  int64_t cheapest = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    int64_t lo = std::numeric_limits<int64_t>::max();
    for (size_t c = 0; c < nc; ++c) {
      for (int s : groups[gi]) {
        cost[gi][c] += detail::bit_units(p.bits[static_cast<size_t>(s)][c]);
        dmg[gi][c] += p.damage[static_cast<size_t>(s)][c];
      }
      if (dmg[gi][c] < inf) lo = std::min(lo, cost[gi][c]);
    }
    KVQ_REQUIRE(lo != std::numeric_limits<int64_t>::max(), kInvalidArgument,
                "plan: slot group ", gi, " has no usable candidate (every damage is +inf)");
    cheapest += lo;
  }
  const int64_t cap = static_cast<int64_t>(std::floor(budget * p.slots() * kPlanBitUnits + 1e-6));
  KVQ_REQUIRE(cheapest <= cap, kInvalidArgument, "plan: budget ", budget,
              " bits is below the cheapest choice of the candidates (",
              static_cast<double>(cheapest) / kPlanBitUnits / p.slots(), " bits per value)");
  // best[u] = least damage of the groups so far at total cost exactly u.
  const size_t width = static_cast<size_t>(cap) + 1;
  std::vector<double> best(width, inf), next(width, inf);
  best[0] = 0;
  std::vector<std::vector<uint8_t>> pick(groups.size(), std::vector<uint8_t>(width, 0xFF));
  KVQ_REQUIRE(nc < 0xFF, kInvalidArgument, "plan: at most 254 candidates, got ", nc);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    std::fill(next.begin(), next.end(), inf);
    for (size_t u = 0; u < width; ++u) {
      if (best[u] == inf) continue;
      for (size_t c = 0; c < nc; ++c) {
        if (dmg[gi][c] == inf) continue;
        const size_t v = u + static_cast<size_t>(cost[gi][c]);
        if (v >= width) continue;
        const double d = best[u] + dmg[gi][c];
        if (d < next[v]) {
          next[v] = d;
          pick[gi][v] = static_cast<uint8_t>(c);
        }
      }
    }
    std::swap(best, next);
  }
  size_t at = 0;
  double least = inf;
  for (size_t u = 0; u < width; ++u) {
    if (best[u] < least) {  // strict: the fewest bits among equal damage
      least = best[u];
      at = u;
    }
  }
  PlanChoice r;
  r.choice.assign(static_cast<size_t>(p.slots()), -1);
  r.granularity = g;
  r.budget = budget;
  for (size_t gi = groups.size(); gi-- > 0;) {
    const int c = pick[gi][at];
    for (int s : groups[gi]) r.choice[static_cast<size_t>(s)] = c;
    at -= static_cast<size_t>(cost[gi][static_cast<size_t>(c)]);
  }
  double bits = 0;
  for (int s = 0; s < p.slots(); ++s) {
    const size_t c = static_cast<size_t>(r.choice[static_cast<size_t>(s)]);
    bits += p.bits[static_cast<size_t>(s)][c];
    r.damage += p.damage[static_cast<size_t>(s)][c];
  }
  r.mean_bits = bits / p.slots();
  return r;
}

/// The policy of a choice: keys and values of layer l use their slots' candidates; the most
/// common (key, value) pair becomes the base and every other layer an override; no residual
/// window, no sinks, no skip (a planned f16 layer is an override).
inline Policy plan_policy(const PlanProblem& p, const PlanChoice& r) {
  KVQ_REQUIRE(r.choice.size() == static_cast<size_t>(p.slots()), kInvalidArgument,
              "plan_policy: the choice has ", r.choice.size(), " slots, the problem ", p.slots());
  std::map<std::pair<int, int>, int> count;
  for (int l = 0; l < p.n_layers; ++l)
    ++count[{r.choice[static_cast<size_t>(2 * l)], r.choice[static_cast<size_t>(2 * l + 1)]}];
  // The base pair is the most common choice among candidates without per-layer configs (a
  // layer that uses a per-layer candidate, nuq with its own codebook, always gets an override).
  const auto uniform = [&](int c) { return p.candidates[static_cast<size_t>(c)].per_layer.empty(); };
  std::pair<int, int> base{-1, -1};
  int most = 0;
  for (const auto& [kv, n] : count) {
    if (n > most && uniform(kv.first) && uniform(kv.second)) {
      most = n;
      base = kv;
    }
  }
  Policy pol;
  if (base.first >= 0) {
    pol.key = p.candidates[static_cast<size_t>(base.first)].key;
    pol.value = p.candidates[static_cast<size_t>(base.second)].value;
  } else {  // every layer overridden: the base is layer 0's choice
    pol.key = p.candidates[static_cast<size_t>(r.choice[0])].key_at(0);
    pol.value = p.candidates[static_cast<size_t>(r.choice[1])].value_at(0);
  }
  for (int l = 0; l < p.n_layers; ++l) {
    const int kc = r.choice[static_cast<size_t>(2 * l)], vc = r.choice[static_cast<size_t>(2 * l + 1)];
    if (std::make_pair(kc, vc) == base) continue;
    pol.overrides[l] = {p.candidates[static_cast<size_t>(kc)].key_at(l),
                        p.candidates[static_cast<size_t>(vc)].value_at(l)};
  }
  pol.validate();
  return pol;
}

/// Learns the per-layer nuq codebooks of every candidate that needs them (needs_codebooks) on
/// `data` (policy/calibrate.hpp: the candidate's keys and values on every layer, no sinks, as
/// plans store them) and keeps them in the candidate's per_layer configs. Deterministic: a
/// layer's codebook depends only on that layer's data and config, so a plan's nuq layers equal
/// what kvq::calibrate learns for the plan's policy on the same data.
inline void calibrate_plan_candidates(std::vector<PlanCandidate>& candidates,
                                      const CalibrationSet& data,
                                      const CalibrationOptions& opt = {}) {
  for (PlanCandidate& c : candidates) {
    if (!c.needs_codebooks()) continue;
    Policy p;
    p.key = c.key;
    p.value = c.value;
    p.residual = 0;
    p.sinks = 0;
    Policy cal;
    try {
      cal = calibrate(p, data, opt);
    } catch (const Error& e) {
      fail(e.kind(), "candidate '", c.name, "': ", e.what());
    }
    c.per_layer.clear();
    for (int l = 0; l < data.n_layers; ++l)
      c.per_layer.emplace_back(cal.key_for(l, data.n_layers), cal.value_for(l, data.n_layers));
  }
}

/// Mean storage bits of `policy` on an n_layers model (keys and values of every layer, the
/// skip rule and overrides applied): what plan_allocate's mean_bits promises, recomputed from
/// the policy alone.
inline double policy_storage_bits(const Policy& policy, int n_layers, int kv_heads, int head_dim) {
  double s = 0;
  for (int l = 0; l < n_layers; ++l) {
    s += storage_bits(policy.key_for(l, n_layers), kv_heads, head_dim);
    s += storage_bits(policy.value_for(l, n_layers), kv_heads, head_dim);
  }
  return s / (2.0 * n_layers);
}

}  // namespace kvq
