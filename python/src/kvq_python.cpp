/// \file kvq_python.cpp
/// The Python binding of kvq: one nanobind module over the public headers (quantize, policy,
/// accountant, cache, attention, KV dumps). Nothing here quantizes: every number comes from the
/// same header code the C++ tools run. The module is compiled once per SIMD variant
/// (KVQ_PY_MODULE / KVQ_PY_VARIANT, see python/CMakeLists.txt); kvq/_loader.py imports the best
/// one the CPU runs.
///
/// Conventions: tensors are [tokens, heads, head_dim] with any non-negative strides; inputs are
/// numpy arrays or DLPack producers (float32, float16, bfloat16, CPU memory); outputs are numpy
/// arrays (which are DLPack producers themselves). kvq::Error becomes kvq.Error (a ValueError)
/// carrying kvq's message and a `kind`; a wrong Python type or dtype is a TypeError. The GIL is
/// released around every call that touches tensor data, and objects that C++ mutates (QTensor
/// via out=, KVCache) carry a reader/writer lock that is taken *after* the GIL is released, so
/// two Python threads never wait on each other while one holds the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>  // getpid

#include "kvq/accounting/accountant.hpp"
#include "kvq/attention/attention.hpp"
#include "kvq/attention/worker_pool.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/config.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/calibrate.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"

#ifndef KVQ_PY_MODULE
#define KVQ_PY_MODULE _kvq_native
#endif
#ifndef KVQ_PY_VARIANT
#define KVQ_PY_VARIANT "native"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---------------------------------------------------------------------------------------------
// Errors

PyObject* g_error_type = nullptr;  // kvq.Error (subclass of ValueError)

const char* kind_name(kvq::ErrorKind k) {
  switch (k) {
    case kvq::ErrorKind::kInvalidArgument: return "invalid_argument";
    case kvq::ErrorKind::kShapeMismatch: return "shape_mismatch";
    case kvq::ErrorKind::kNonFinite: return "non_finite";
    case kvq::ErrorKind::kOutOfRange: return "out_of_range";
    case kvq::ErrorKind::kParse: return "parse";
    case kvq::ErrorKind::kIo: return "io";
    case kvq::ErrorKind::kUnsupported: return "unsupported";
  }
  return "error";
}

/// A TypeError with a kvq-style message (wrong Python type or dtype).
[[noreturn]] void type_error(const std::string& msg) {
  throw nb::type_error(("kvq: type error: " + msg).c_str());
}

std::string py_type_name(nb::handle h) {
  return nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr())))
                                           .attr("__name__")));
}

// ---------------------------------------------------------------------------------------------
// Input tensors

using AnyArray = nb::ndarray<nb::ro>;

/// A checked [tokens, heads, head_dim] input: the DLPack/numpy array kept alive plus its view.
struct InTensor {
  AnyArray arr;  // owns a reference to the producer while the GIL is released
  kvq::DType dtype = kvq::DType::kF32;
  kvq::Shape shape;
  kvq::Strides strides;
  const void* data = nullptr;

  template <class T>
  kvq::KVView<const T> view() const {
    return kvq::KVView<const T>(static_cast<const T*>(data), shape, strides);
  }
};

std::string dtype_str(nb::dlpack::dtype d) {
  const char* base = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
  }
  return std::string(base) + std::to_string(d.bits);
}

const char* device_str(int t) {
  switch (t) {
    case nb::device::cpu::value: return "cpu";
    case nb::device::cuda::value: return "cuda";
    case nb::device::cuda_host::value: return "cuda_host";
    case nb::device::cuda_managed::value: return "cuda_managed";
    case nb::device::rocm::value: return "rocm";
    case nb::device::metal::value: return "metal";
    default: return "a non-CPU device";
  }
}

/// Any numpy array or DLPack producer as a rank-`rank` float tensor in CPU memory. `fn` and
/// `name` go into messages ("kvq.quantize: x ...").
AnyArray as_float_array(nb::handle obj, const char* fn, const char* name, size_t rank) {
  AnyArray a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    type_error(kvq::detail::cat(fn, ": ", name,
                                " must be a numpy array or a DLPack tensor (float32, float16 or "
                                "bfloat16), got ",
                                py_type_name(obj)));
  }
  if (a.device_type() != nb::device::cpu::value)
    kvq::fail(kvq::ErrorKind::kInvalidArgument, fn, ": ", name, " lives on ",
              device_str(a.device_type()),
              "; kvq reads CPU memory (move the tensor to the CPU first, e.g. .cpu())");
  const nb::dlpack::dtype d = a.dtype();
  const bool ok = d.lanes == 1 && ((d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) &&
                                    (d.bits == 32 || d.bits == 16)) ||
                                   (d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
                                    d.bits == 16));
  if (!ok)
    type_error(kvq::detail::cat(fn, ": ", name, " has dtype ", dtype_str(d),
                                "; kvq reads float32, float16 or bfloat16"));
  if (a.ndim() != rank) {
    std::string s = "(";
    for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    s += a.ndim() == 1 ? ",)" : ")";
    kvq::fail(kvq::ErrorKind::kShapeMismatch, fn, ": ", name, " must have ", rank,
              rank == 3 ? " dimensions [tokens, heads, head_dim]" : " dimensions",
              ", got shape ", s);
  }
  return a;
}

kvq::DType kvq_dtype(const AnyArray& a) {
  const nb::dlpack::dtype d = a.dtype();
  if (d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat)) return kvq::DType::kBF16;
  return d.bits == 32 ? kvq::DType::kF32 : kvq::DType::kF16;
}

InTensor as_tensor(nb::handle obj, const char* fn, const char* name) {
  InTensor t;
  t.arr = as_float_array(obj, fn, name, 3);
  t.dtype = kvq_dtype(t.arr);
  t.shape = kvq::Shape{static_cast<int64_t>(t.arr.shape(0)), static_cast<int64_t>(t.arr.shape(1)),
                       static_cast<int64_t>(t.arr.shape(2))};
  t.strides = kvq::Strides{t.arr.stride(0), t.arr.stride(1), t.arr.stride(2)};
  t.data = t.arr.data();
  // Validate the view here, with the GIL held, so errors carry kvq's message at once.
  kvq::detail::check_view(t.shape, t.strides);
  return t;
}

/// Calls fn(KVView<const T>) with the view of `t` in its own element type.
template <class Fn>
decltype(auto) visit(const InTensor& t, Fn&& fn) {
  switch (t.dtype) {
    case kvq::DType::kF16: return fn(t.view<kvq::f16>());
    case kvq::DType::kBF16: return fn(t.view<kvq::bf16>());
    case kvq::DType::kF32: break;
  }
  return fn(t.view<float>());
}

// ---------------------------------------------------------------------------------------------
// Output arrays

using NpArray = nb::ndarray<nb::numpy>;

/// An uninitialized C-contiguous numpy array of `shape` and element size `elem` that owns its
/// memory (freed when numpy drops it).
struct OutBuffer {
  void* data = nullptr;
  NpArray array;
};

OutBuffer new_array(std::vector<size_t> shape, nb::dlpack::dtype dtype) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  const size_t bytes = std::max<size_t>(1, n * (dtype.bits / 8));
  auto* mem = static_cast<uint8_t*>(::operator new[](bytes));
  nb::capsule owner(mem, [](void* p) noexcept { ::operator delete[](p); });
  OutBuffer o;
  o.data = mem;
  o.array = NpArray(mem, shape.size(), shape.data(), owner, nullptr, dtype);
  return o;
}

nb::dlpack::dtype np_dtype(kvq::DType d) {
  switch (d) {
    case kvq::DType::kF16: return nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case kvq::DType::kBF16: return nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case kvq::DType::kF32: break;
  }
  return nb::dtype<float>();
}

std::vector<size_t> shape_vec(const kvq::Shape& s) {
  return {static_cast<size_t>(s.tokens), static_cast<size_t>(s.heads),
          static_cast<size_t>(s.head_dim)};
}

/// "float32"/"float16", numpy dtypes and scalar types, torch dtypes -> kvq::DType for outputs.
kvq::DType out_dtype(nb::handle dtype, const char* fn) {
  std::string s;
  if (nb::isinstance<nb::str>(dtype)) {
    s = nb::cast<std::string>(dtype);
  } else {
    s = nb::cast<std::string>(nb::str(dtype));
    if (s.rfind("torch.", 0) == 0) {
      s = s.substr(6);
    } else {
      try {  // numpy.float16, numpy.dtype("float16"), ...
        s = nb::cast<std::string>(nb::module_::import_("numpy").attr("dtype")(dtype).attr("name"));
      } catch (const nb::python_error&) {
      }
    }
  }
  if (s == "float32" || s == "f32" || s == "float") return kvq::DType::kF32;
  if (s == "float16" || s == "f16" || s == "half") return kvq::DType::kF16;
  type_error(kvq::detail::cat(fn, ": dtype must be float32 or float16 (numpy has no bfloat16; pass "
                              "out= a bfloat16 tensor instead), got '",
                              s, "'"));
}

// ---------------------------------------------------------------------------------------------
// Configs, policies

const char* format_name(const kvq::QuantConfig& c) {
  switch (c.format) {
    case kvq::Format::kInt: return c.symmetric ? "sint" : "int";
    default: return kvq::to_string(c.format);
  }
}

kvq::QuantConfig config_from(nb::handle obj, const char* fn) {
  if (nb::isinstance<kvq::QuantConfig>(obj)) return nb::cast<kvq::QuantConfig>(obj);
  if (nb::isinstance<nb::str>(obj)) return kvq::parse_quant_config(nb::cast<std::string>(obj));
  type_error(kvq::detail::cat(fn, ": config must be a kvq.QuantConfig or a spec term such as "
                              "'int4/token/g32', got ",
                              py_type_name(obj)));
}

kvq::Policy policy_from(nb::handle obj, const char* fn) {
  if (nb::isinstance<kvq::Policy>(obj)) return nb::cast<kvq::Policy>(obj);
  if (nb::isinstance<nb::str>(obj)) return kvq::parse_policy(nb::cast<std::string>(obj));
  type_error(kvq::detail::cat(fn, ": policy must be a kvq.Policy or a spec string such as "
                              "'k8v4', got ",
                              py_type_name(obj)));
}

kvq::Shape shape_from(const std::vector<int64_t>& s, const char* fn) {
  KVQ_REQUIRE(s.size() == 3, kShapeMismatch, fn,
              ": shape must be (tokens, heads, head_dim), got ", s.size(), " extents");
  KVQ_REQUIRE(s[0] >= 0 && s[1] >= 0 && s[2] >= 0, kShapeMismatch, fn,
              ": shape extents must be >= 0, got (", s[0], ", ", s[1], ", ", s[2], ")");
  return kvq::Shape{s[0], s[1], s[2]};
}

/// ByteBreakdown fields that not every kvq version has (the cache's insides are evolving): the
/// dict carries whichever the headers define.
template <class B>
auto add_seeds(nb::dict& d, const B& b, int) -> decltype(b.seeds, void()) {
  d["seeds"] = b.seeds;
}
template <class B>
void add_seeds(nb::dict&, const B&, long) {}
template <class B>
auto add_padding(nb::dict& d, const B& b, int) -> decltype(b.padding, void()) {
  d["padding"] = b.padding;
}
template <class B>
void add_padding(nb::dict&, const B&, long) {}

nb::dict breakdown_dict(const kvq::ByteBreakdown& b) {
  nb::dict d;
  d["codes"] = b.codes;
  d["scales"] = b.scales;
  d["zeros"] = b.zeros;
  d["norms"] = b.norms;
  d["residual"] = b.residual;
  d["outliers"] = b.outliers;
  d["codebooks"] = b.codebooks;
  add_seeds(d, b, 0);
  add_padding(d, b, 0);
  d["total"] = b.total();
  return d;
}

template <class S>
auto add_rollback(nb::dict& d, const S& s, int) -> decltype(s.rollback, void()) {
  d["rollback"] = s.rollback;
}
template <class S>
void add_rollback(nb::dict&, const S&, long) {}
template <class R>
auto scratch_of(const R& r, int) -> decltype(static_cast<size_t>(r.scratch)) {
  return r.scratch;
}
template <class R>
size_t scratch_of(const R&, long) {
  return 0;
}

nb::dict stream_dict(const kvq::StreamBytes& s) {
  nb::dict d;
  d["packed"] = breakdown_dict(s.packed);
  d["sinks"] = s.sinks;
  d["residual"] = s.residual;
  add_rollback(d, s, 0);
  d["total"] = s.total();
  return d;
}

// ---------------------------------------------------------------------------------------------
// Mutable objects shared with C++ while the GIL is released

/// Buffers of the last QTensor Python dropped, handed to the next kvq.quantize() without out=.
/// Fresh multi-MiB vectors cost first-touch page faults plus value-initialization on every call
/// (measured ~1.3-1.6x the quantization itself for 64 MiB of int4 input on this VM); with one
/// recycled tensor, `q = kvq.quantize(x, cfg)` in a loop reuses memory the way the C++ loop
/// `quantize(cfg, x, q)` does. At most one tensor of at most kRecycleMaxBytes is kept.
struct Recycler {
  static constexpr size_t kRecycleMaxBytes = size_t{64} << 20;
  std::mutex mu;
  kvq::QTensor slot;
  bool full = false;

  static size_t capacity(const kvq::QTensor& q) {
    return q.codes.capacity() + q.scales.raw().capacity() + q.zeros.raw().capacity() +
           q.norms.raw().capacity() + q.qjl_signs.capacity() + q.qjl_norms.raw().capacity();
  }
  void give(kvq::QTensor& q) {
    const size_t c = capacity(q);
    if (c < (size_t{1} << 20) || c > kRecycleMaxBytes) return;
    std::lock_guard<std::mutex> lk(mu);
    if (!full) {
      slot = std::move(q);
      full = true;
    }
  }
  void take(kvq::QTensor& q) {
    std::lock_guard<std::mutex> lk(mu);
    if (full) {
      q = std::move(slot);
      slot = kvq::QTensor();
      full = false;
    }
  }
};
Recycler& recycler() {
  static Recycler* r = new Recycler();  // never destroyed: no teardown-order issues at exit
  return *r;
}

/// A QTensor plus the lock that guards it against `quantize(..., out=q)` from another thread.
// ---------------------------------------------------------------------------------------------
// Attention options (kvq::AttentionOptions) from Python keywords

using PosArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MaskArray = nb::ndarray<const bool, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using SinkArray = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// The options of one attend / attend_batch call and the arrays they point into (copied, so
/// the GIL can be released).
struct PyAttn {
  kvq::AttentionOptions opt;
  std::vector<int64_t> positions;
  std::vector<uint64_t> mask_bits;
  std::vector<float> sinks;
  OutBuffer lse;
  bool want_lse = false;
};

/// Checks and copies the keywords for `rows` query rows of `n_heads` heads over sequences of at
/// most `max_tokens` tokens. `mask`: [rows, >= max_tokens] bool, True where the row sees the
/// position (within its sequence).
PyAttn attention_options(const char* fn, int64_t rows, int64_t n_heads, int64_t max_tokens,
                         double scale, double softcap, int64_t window,
                         const std::optional<PosArray>& positions,
                         const std::optional<MaskArray>& mask,
                         const std::optional<SinkArray>& sinks, int threads,
                         int64_t split_tokens, bool return_lse, const std::string& dot) {
  PyAttn a;
  KVQ_REQUIRE(dot == "exact" || dot == "int8", kInvalidArgument, fn,
              ": dot must be 'exact' or 'int8', got '", dot, "'");
  a.opt.dot = dot == "int8" ? kvq::DotProduct::kInt8 : kvq::DotProduct::kExact;
  KVQ_REQUIRE(threads >= 1, kInvalidArgument, fn, ": threads must be >= 1, got ", threads);
  KVQ_REQUIRE(window >= 0, kInvalidArgument, fn, ": window must be >= 0, got ", window);
  KVQ_REQUIRE(split_tokens >= 0, kInvalidArgument, fn, ": split_tokens must be >= 0, got ",
              split_tokens);
  a.opt.threads = threads;
  a.opt.split_tokens = split_tokens;
  a.opt.window = window;
  a.opt.scale = static_cast<float>(scale);      // checked (finite, >= 0) by the kernels
  a.opt.softcap = static_cast<float>(softcap);
  if (positions) {
    KVQ_REQUIRE(static_cast<int64_t>(positions->shape(0)) == rows, kShapeMismatch, fn,
                ": positions must hold one entry per query row (", rows, "), got ",
                positions->shape(0));
    a.positions.assign(positions->data(), positions->data() + rows);
    a.opt.positions = a.positions.data();
  }
  if (mask) {
    const int64_t cols = static_cast<int64_t>(mask->shape(1));
    KVQ_REQUIRE(static_cast<int64_t>(mask->shape(0)) == rows && cols >= max_tokens,
                kShapeMismatch, fn, ": mask must be [", rows, ", >= ", max_tokens,
                "] (query rows x positions), got [", mask->shape(0), ", ", cols, "]");
    const int64_t words = std::max<int64_t>(1, (cols + 63) / 64);
    a.mask_bits.assign(static_cast<std::size_t>(rows * words), 0);
    const bool* m = mask->data();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t t = 0; t < cols; ++t)
        if (m[i * cols + t])
          a.mask_bits[static_cast<std::size_t>(i * words + t / 64)] |= uint64_t{1} << (t % 64);
    a.opt.mask_bits = a.mask_bits.data();
    a.opt.mask_words = words;
  }
  if (sinks) {
    KVQ_REQUIRE(static_cast<int64_t>(sinks->shape(0)) == n_heads, kShapeMismatch, fn,
                ": sinks must hold one logit per query head (", n_heads, "), got ",
                sinks->shape(0));
    a.sinks.assign(sinks->data(), sinks->data() + n_heads);
    a.opt.sinks = a.sinks.data();
  }
  if (return_lse) {
    a.want_lse = true;
    a.lse = new_array({static_cast<size_t>(rows), static_cast<size_t>(n_heads)}, nb::dtype<float>());
    a.opt.lse = static_cast<float*>(a.lse.data);
  }
  return a;
}

/// Module-wide workers for `threads=n` (n >= 2): one kvq::WorkerPool per thread count, started
/// by the first call that asks for it and kept for the life of the process, so that a call wakes
/// n - 1 waiting workers instead of starting and joining n - 1 std::threads (50-70 us per call
/// on the hosts of docs/benchmarks.md, as much as a short decode step). A pool serves one call at
/// a time: a call that finds its pool busy (another Python thread inside it) starts its own
/// std::threads rather than wait. Results never depend on which ran (the kernels'
/// determinism guarantee, docs/cache.md).
///
/// fork(): a child process has none of its parent's worker threads, and a pool's locks may have
/// been held by a parent thread at the fork. Each registry belongs to the process that made it;
/// a child that finds its parent's registry starts its own and drops the parent's without
/// destroying it (destroying would join threads that do not exist in the child).
class SharedWorkers {
  struct Entry {
    explicit Entry(int threads) : pool(threads) {}
    kvq::WorkerPool pool;
    std::atomic<bool> busy{false};
    int64_t served = 0;  // guarded by the registry's mutex
  };

 public:
  static constexpr int kMaxPools = 8;      // distinct thread counts kept; more use std::threads
  static constexpr int kMaxThreads = 256;  // larger requests use std::threads

  /// Sets opt.parallel_for to a shared pool of opt.threads workers while it lives, when one is
  /// free; otherwise leaves opt as it was (the kernels then start std::threads).
  class Lease {
   public:
    explicit Lease(kvq::AttentionOptions& opt) {
      if (opt.threads < 2 || opt.threads > kMaxThreads || opt.parallel_for ||
          !enabled().load(std::memory_order_relaxed))
        return;
      entry_ = claim(opt.threads);
      if (entry_ != nullptr) entry_->pool.configure(opt);
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (entry_ != nullptr) entry_->busy.store(false, std::memory_order_release);
    }

   private:
    Entry* entry_ = nullptr;
  };

  /// Whether calls use the pools (kvq.use_worker_pools()); their workers stay either way.
  static std::atomic<bool>& enabled() {
    static std::atomic<bool> on{true};
    return on;
  }
  static bool set_enabled(bool on) { return enabled().exchange(on); }

  /// {threads: calls served} of this process's pools (kvq.worker_pools()).
  static std::map<int, int64_t> served() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    std::map<int, int64_t> out;
    for (const auto& e : r.pools) out[e.first] = e.second->served;
    return out;
  }

 private:
  struct Registry {
    long pid = 0;
    std::mutex mu;
    std::map<int, Entry*> pools;  // never destroyed: the workers live as long as the process
  };

  /// This process's registry (a fresh one after fork()).
  static Registry& registry() {
    static std::atomic<Registry*> current{nullptr};
    const long pid = static_cast<long>(::getpid());
    Registry* r = current.load(std::memory_order_acquire);
    while (r == nullptr || r->pid != pid) {
      auto* mine = new Registry();
      mine->pid = pid;
      if (current.compare_exchange_strong(r, mine, std::memory_order_acq_rel)) return *mine;
      delete mine;  // another thread of this process installed one first: r now points to it
    }
    return *r;
  }

  /// The pool of `threads` workers, marked busy; nullptr when it is busy or cannot be kept.
  static Entry* claim(int threads) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    auto it = r.pools.find(threads);
    if (it == r.pools.end()) {
      if (static_cast<int>(r.pools.size()) >= kMaxPools) return nullptr;
      it = r.pools.emplace(threads, new Entry(threads)).first;
    }
    Entry* e = it->second;
    if (e->busy.exchange(true, std::memory_order_acquire)) return nullptr;
    ++e->served;
    return e;
  }
};

/// The queries of an attention call as an f32 view (f16/bf16 widened exactly into `buf`).
kvq::KVView<const float> f32_queries(const InTensor& qt, std::vector<float>& buf) {
  if (qt.dtype == kvq::DType::kF32) return qt.view<float>();
  buf = visit(qt, [](auto view) { return kvq::to_float_nhd(view); });
  return kvq::KVView<const float>(buf.data(), qt.shape);
}

/// The output (and, with return_lse, the log-sum-exp array) of an attention call.
nb::object attention_result(const OutBuffer& o, const PyAttn& a) {
  if (!a.want_lse) return nb::cast(o.array);
  return nb::make_tuple(o.array, a.lse.array);
}

struct PyQTensor {
  PyQTensor() = default;
  PyQTensor(const PyQTensor&) = delete;
  PyQTensor& operator=(const PyQTensor&) = delete;
  ~PyQTensor() { recycler().give(q); }
  kvq::QTensor q;
  mutable std::shared_mutex mu;
};

struct PyCache {
  PyCache(kvq::Policy p, int n_layers, int kv_heads, int head_dim, int max_tokens)
      : cache(std::move(p), n_layers, kv_heads, head_dim, max_tokens) {}
  /// Copy of another cache (a template, so that it is only compiled where KVCache copies).
  template <class C>
  PyCache(const C& other, int) : cache(other) {}
  /// Takes a cache (a fork).
  explicit PyCache(kvq::KVCache&& c) : cache(std::move(c)) {}
  kvq::KVCache cache;
  mutable std::shared_mutex mu;
};

/// An independent copy of c's cache (same bytes, same configs); the HF adapter's beam search
/// duplicates batch rows with it.
template <class C>
PyCache* copy_cache(const C& c, const PyCache& self) {
  if constexpr (std::is_copy_constructible_v<C>) {
    nb::gil_scoped_release nogil;
    std::shared_lock<std::shared_mutex> lk(self.mu);
    return new PyCache(c, 0);
  } else {
    kvq::fail(kvq::ErrorKind::kUnsupported, "KVCache.copy: this kvq build's cache cannot be copied");
  }
}

nb::bytes to_bytes(const uint8_t* p, size_t n) { return nb::bytes(reinterpret_cast<const char*>(p), n); }

/// Dequantizes q into a fresh numpy array of `dt` (GIL released, shared lock held).
NpArray dequantize_to(const PyQTensor& t, kvq::DType dt) {
  kvq::Shape shape;
  {
    std::shared_lock<std::shared_mutex> lk(t.mu);
    shape = t.q.shape;
  }
  OutBuffer o = new_array(shape_vec(shape), np_dtype(dt));
  {
    nb::gil_scoped_release nogil;
    std::shared_lock<std::shared_mutex> lk(t.mu);
    KVQ_REQUIRE(t.q.shape == shape, kShapeMismatch,
                "QTensor.dequantize: the tensor was re-quantized by another thread");
    if (dt == kvq::DType::kF16) {
      kvq::dequantize(t.q, kvq::KVView<kvq::f16>(static_cast<kvq::f16*>(o.data), shape));
    } else {
      kvq::dequantize(t.q, kvq::KVView<float>(static_cast<float*>(o.data), shape));
    }
  }
  return o.array;
}

/// Dequantizes into a caller's writable array (float32 or float16, any strides).
void dequantize_into(const PyQTensor& t, nb::handle out) {
  nb::ndarray<> a;
  if (!nb::try_cast(out, a, false))
    type_error("QTensor.dequantize: out must be a writable numpy array or DLPack tensor, got " +
               py_type_name(out));
  if (a.device_type() != nb::device::cpu::value)
    kvq::fail(kvq::ErrorKind::kInvalidArgument, "QTensor.dequantize: out lives on ",
              device_str(a.device_type()), "; kvq writes CPU memory");
  const nb::dlpack::dtype d = a.dtype();
  const bool f32 = d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 32;
  const bool f16 = d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 16;
  const bool b16 = d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16;
  if (d.lanes != 1 || !(f32 || f16 || b16))
    type_error("QTensor.dequantize: out has dtype " + dtype_str(d) +
               "; kvq writes float32, float16 or bfloat16");
  KVQ_REQUIRE(a.ndim() == 3, kShapeMismatch, "QTensor.dequantize: out must have 3 dimensions, got ",
              a.ndim());
  const kvq::Shape s{static_cast<int64_t>(a.shape(0)), static_cast<int64_t>(a.shape(1)),
                     static_cast<int64_t>(a.shape(2))};
  const kvq::Strides st{a.stride(0), a.stride(1), a.stride(2)};
  kvq::detail::check_view(s, st);
  nb::gil_scoped_release nogil;
  std::shared_lock<std::shared_mutex> lk(t.mu);
  if (f32) kvq::dequantize(t.q, kvq::KVView<float>(static_cast<float*>(a.data()), s, st));
  if (f16) kvq::dequantize(t.q, kvq::KVView<kvq::f16>(static_cast<kvq::f16*>(a.data()), s, st));
  if (b16) kvq::dequantize(t.q, kvq::KVView<kvq::bf16>(static_cast<kvq::bf16*>(a.data()), s, st));
}

// ---------------------------------------------------------------------------------------------
// KV dumps

/// An io::Array holding a contiguous copy of a [tokens, heads, head_dim] input (dtype kept).
kvq::io::Array to_io_array(nb::handle obj, const char* name) {
  const InTensor t = as_tensor(obj, "kvq.save_kv_dump", name);
  kvq::io::Array a;
  a.dtype = t.dtype;
  a.shape = {t.shape.tokens, t.shape.heads, t.shape.head_dim};
  const size_t es = static_cast<size_t>(kvq::dtype_size(t.dtype));
  a.bytes.resize(static_cast<size_t>(t.shape.numel()) * es);
  const auto* src = static_cast<const uint8_t*>(t.data);
  size_t o = 0;
  for (int64_t i = 0; i < t.shape.tokens; ++i)
    for (int64_t h = 0; h < t.shape.heads; ++h)
      for (int64_t d = 0; d < t.shape.head_dim; ++d, o += es)
        std::memcpy(a.bytes.data() + o,
                    src + static_cast<size_t>(i * t.strides.token + h * t.strides.head +
                                              d * t.strides.dim) *
                              es,
                    es);
  return a;
}

/// An io::Array as numpy: f32 and f16 keep their dtype, bf16 becomes float32 (numpy has no
/// bfloat16; the conversion is exact).
NpArray from_io_array(const kvq::io::Array& a) {
  std::vector<size_t> shape;
  for (int64_t s : a.shape) shape.push_back(static_cast<size_t>(s));
  if (a.dtype == kvq::DType::kBF16) {
    const std::vector<float> f = a.to_float();
    OutBuffer o = new_array(shape, nb::dtype<float>());
    if (!f.empty()) std::memcpy(o.data, f.data(), f.size() * sizeof(float));
    return o.array;
  }
  OutBuffer o = new_array(shape, np_dtype(a.dtype));
  if (!a.bytes.empty()) std::memcpy(o.data, a.bytes.data(), a.bytes.size());
  return o.array;
}

const char* kKinds[] = {"k", "v", "q", "k_prerope"};

/// A KV dump from a list of layer dicts {'k': ..., 'v': ..., optional 'q', 'k_prerope'}
/// (copies; the GIL is held). `fn` names the caller in messages.
kvq::io::KVDump dump_from_layers(nb::handle layers, const char* fn) {
  if (!nb::isinstance<nb::sequence>(layers) || nb::isinstance<nb::str>(layers))
    type_error(kvq::detail::cat(fn, ": layers must be a list of dicts {'k': ..., 'v': ..., "
                                "optional 'q', 'k_prerope'}, got ",
                                py_type_name(layers)));
  kvq::io::KVDump dump;
  size_t i = 0;
  for (nb::handle item : layers) {
    if (!nb::isinstance<nb::dict>(item))
      type_error(kvq::detail::cat(fn, ": layer ", i, " must be a dict, got ",
                                  py_type_name(item)));
    nb::dict d = nb::borrow<nb::dict>(item);
    for (auto [key, value] : d) {
      const std::string k = nb::cast<std::string>(nb::str(key));
      bool known = false;
      for (const char* kk : kKinds) known = known || k == kk;
      KVQ_REQUIRE(known, kInvalidArgument, fn, ": layer ", i,
                  " has an unknown entry '", k, "' (expected k, v, q, k_prerope)");
    }
    KVQ_REQUIRE(d.contains("k") && d.contains("v"), kInvalidArgument,
                fn, ": layer ", i, " needs both 'k' and 'v'");
    kvq::io::KVDump::Layer L;
    const std::string base = "layers." + std::to_string(i) + ".";
    L.k = to_io_array(d["k"], (base + "k").c_str());
    L.v = to_io_array(d["v"], (base + "v").c_str());
    if (d.contains("q")) L.q = to_io_array(d["q"], (base + "q").c_str());
    if (d.contains("k_prerope"))
      L.k_prerope = to_io_array(d["k_prerope"], (base + "k_prerope").c_str());
    dump.layers.push_back(std::move(L));
    ++i;
  }
  return dump;
}

}  // namespace

NB_MODULE(KVQ_PY_MODULE, m) {
  m.doc() = "kvq: geometry-first KV-cache quantization (nanobind binding of the C++ headers)";
  m.attr("__version__") = KVQ_VERSION_STRING;
  m.attr("variant") = KVQ_PY_VARIANT;
  m.def(
      "attend_batch",
      [](const std::vector<const PyCache*>& caches, int layer, nb::handle q,
         std::optional<std::vector<int64_t>> queries, bool causal, double scale, double softcap,
         int64_t window, std::optional<PosArray> positions, std::optional<MaskArray> mask,
         std::optional<SinkArray> sinks, int threads, int64_t split_tokens, bool return_lse,
         const std::string& dot) {
        const char* fn = "kvq.attend_batch";
        const InTensor qt = as_tensor(q, fn, "q");
        const std::size_t B = caches.size();
        std::vector<int64_t> nq = queries ? *queries : std::vector<int64_t>(B, 1);
        KVQ_REQUIRE(nq.size() == B, kShapeMismatch, fn, ": ", B, " caches but ", nq.size(),
                    " query counts");
        int64_t rows = 0;
        for (std::size_t s = 0; s < B; ++s) {
          KVQ_REQUIRE(caches[s] != nullptr, kInvalidArgument, fn, ": cache ", s, " is None");
          KVQ_REQUIRE(nq[s] >= 0, kInvalidArgument, fn, ": sequence ", s, " has ", nq[s],
                      " query rows");
          rows += nq[s];
        }
        KVQ_REQUIRE(rows == qt.shape.tokens, kShapeMismatch, fn, ": the query counts add up to ",
                    rows, " rows but q holds ", qt.shape.tokens);
        // Distinct caches, each locked once (shared), in address order.
        std::vector<const PyCache*> locks(caches.begin(), caches.end());
        std::sort(locks.begin(), locks.end());
        locks.erase(std::unique(locks.begin(), locks.end()), locks.end());
        int64_t max_tokens = 0;
        for (const PyCache* c : locks) {
          std::shared_lock<std::shared_mutex> lk(c->mu);
          KVQ_REQUIRE(layer >= 0 && layer < c->cache.n_layers(), kOutOfRange, fn, ": layer ",
                      layer, " out of range [0, ", c->cache.n_layers(), ")");
          max_tokens = std::max(max_tokens, c->cache.tokens(layer));
        }
        PyAttn a = attention_options(fn, rows, qt.shape.heads, max_tokens, scale, softcap, window,
                                     positions, mask, sinks, threads, split_tokens, return_lse,
                                     dot);
        OutBuffer o = new_array(shape_vec(qt.shape), nb::dtype<float>());
        {
          nb::gil_scoped_release nogil;
          std::vector<float> qf;
          const kvq::KVView<const float> qv = f32_queries(qt, qf);
          std::vector<std::shared_lock<std::shared_mutex>> held;
          held.reserve(locks.size());
          for (const PyCache* c : locks) held.emplace_back(c->mu);
          std::vector<const kvq::KVCache*> cs;
          int64_t now_max = 0;
          for (const PyCache* c : caches) {
            cs.push_back(&c->cache);
            now_max = std::max(now_max, c->cache.tokens(layer));
          }
          KVQ_REQUIRE(now_max <= max_tokens || !a.opt.mask_bits, kShapeMismatch, fn,
                      ": a cache grew while the mask was read");
          kvq::CacheBatch cb;
          kvq::BatchAttentionWorkspace ws;
          SharedWorkers::Lease workers(a.opt);
          kvq::attend_batch(cb.gather(cs, layer, nq), qv,
                            kvq::KVView<float>(static_cast<float*>(o.data), qt.shape), causal, ws,
                            nullptr, a.opt);
        }
        return attention_result(o, a);
      },
      "caches"_a, "layer"_a, "q"_a, nb::arg("queries").none() = nb::none(), "causal"_a = true,
      nb::kw_only(), "scale"_a = 0.0, "softcap"_a = 0.0, "window"_a = 0,
      nb::arg("positions").none() = nb::none(), nb::arg("mask").none() = nb::none(),
      nb::arg("sinks").none() = nb::none(), "threads"_a = 1, "split_tokens"_a = 0,
      "return_lse"_a = false, "dot"_a = "exact",
      "Batched attention over several caches (one sequence each): q [sum(queries), n_heads, "
      "head_dim]; queries[s] rows per cache (default one: decode). Same options as "
      "KVCache.attend, indexed by the global query row.");
  m.def("worker_pools", &SharedWorkers::served,
        "{threads: calls served} of the module's shared worker pools in this process: a call "
        "with threads=n >= 2 runs on a pool of n workers started once (not n - 1 new threads "
        "per call) unless another thread is using that pool.");
  m.def("use_worker_pools", &SharedWorkers::set_enabled, "on"_a,
        "Whether attention calls with threads >= 2 run on the shared worker pools (default "
        "True) or start threads of their own per call, as C++ does without a parallel_for; "
        "returns the previous setting. Pools already started keep their (sleeping) workers.");
  m.def("simd_level", &kvq::simd_level,
        "SIMD level the fast paths of this build were compiled for (avx512, avx2 or scalar).");

  // kvq.Error: ValueError carrying kvq's message and its kind.
  g_error_type = PyErr_NewExceptionWithDoc(
      "kvq.Error",
      "Bad input reported by kvq (its message names the problem). `kind` is one of "
      "invalid_argument, shape_mismatch, non_finite, out_of_range, parse, io, unsupported.",
      PyExc_ValueError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvq::Error& e) {
      PyObject* exc = PyObject_CallFunction(g_error_type, "s", e.what());
      if (exc == nullptr) return;  // the constructor failed: its exception stands
      PyObject* kind = PyUnicode_FromString(kind_name(e.kind()));
      if (kind != nullptr) {
        PyObject_SetAttrString(exc, "kind", kind);
        Py_DECREF(kind);
      }
      PyErr_SetObject(g_error_type, exc);
      Py_DECREF(exc);
    }
  });

  // ------------------------------------------------------------------------------ QuantConfig
  nb::class_<kvq::QuantConfig>(m, "QuantConfig")
      .def(
          "__init__",
          [](kvq::QuantConfig* self, const std::string& spec) {
            new (self) kvq::QuantConfig(kvq::parse_quant_config(spec));
          },
          "spec"_a)
      .def_static(
          "int",
          [](int bits, const std::string& axis, int64_t group, bool symmetric, bool f32meta) {
            kvq::Axis a{};
            KVQ_REQUIRE(kvq::detail::lookup_axis(axis, a), kInvalidArgument,
                        "QuantConfig.int: unknown axis '", axis,
                        "' (expected token, channel, head or tensor)");
            kvq::QuantConfig c = kvq::int_config(bits, a, group, symmetric);
            if (f32meta) c.meta = kvq::MetaDType::kF32;
            kvq::validate_config(c, "QuantConfig.int", false);
            return c;
          },
          "bits"_a, "axis"_a = "token", "group"_a = kvq::kDefaultIntGroup, "symmetric"_a = false,
          "f32meta"_a = false)
      .def_static(
          "fp8",
          [](const std::string& fmt, const std::string& axis, int64_t group, bool f32meta) {
            KVQ_REQUIRE(fmt == "e4m3" || fmt == "e5m2", kInvalidArgument,
                        "QuantConfig.fp8: format must be e4m3 or e5m2, got '", fmt, "'");
            kvq::Axis a{};
            KVQ_REQUIRE(kvq::detail::lookup_axis(axis, a), kInvalidArgument,
                        "QuantConfig.fp8: unknown axis '", axis,
                        "' (expected token, head or tensor)");
            kvq::QuantConfig c = kvq::fp8_config(
                fmt == "e4m3" ? kvq::Format::kE4M3 : kvq::Format::kE5M2, a, group);
            if (f32meta) c.meta = kvq::MetaDType::kF32;
            kvq::validate_config(c, "QuantConfig.fp8", false);
            return c;
          },
          "format"_a = "e4m3", "axis"_a = "head", "group"_a = 0, "f32meta"_a = false)
      .def_static(
          "fp4",
          [](const std::string& fmt, float tensor_scale) {
            KVQ_REQUIRE(fmt == "nvfp4" || fmt == "mxfp4", kInvalidArgument,
                        "QuantConfig.fp4: format must be nvfp4 or mxfp4, got '", fmt, "'");
            KVQ_REQUIRE(fmt == "nvfp4" || tensor_scale == 1.0f, kInvalidArgument,
                        "QuantConfig.fp4: mxfp4 has no tensor scale (its block scales are "
                        "powers of two), got tensor_scale=", tensor_scale);
            kvq::QuantConfig c = kvq::fp4_config(
                fmt == "nvfp4" ? kvq::Format::kNvfp4 : kvq::Format::kMxfp4, tensor_scale);
            kvq::validate_config(c, "QuantConfig.fp4", false);
            return c;
          },
          "format"_a = "nvfp4", "tensor_scale"_a = 1.0f)
      .def_static(
          "raw",
          [](const std::string& fmt) {
            KVQ_REQUIRE(fmt == "f32" || fmt == "f16" || fmt == "bf16", kInvalidArgument,
                        "QuantConfig.raw: format must be f32, f16 or bf16, got '", fmt, "'");
            return kvq::raw_config(fmt == "f32"   ? kvq::Format::kF32
                                   : fmt == "f16" ? kvq::Format::kF16
                                                  : kvq::Format::kBF16);
          },
          "format"_a)
      .def_static(
          "lloyd_max",
          [](int bits, bool qjl, bool f32meta) {
            kvq::QuantConfig c = kvq::lm_config(bits, qjl);
            if (f32meta) c.meta = kvq::MetaDType::kF32;
            kvq::validate_config(c, "QuantConfig.lloyd_max", true);
            return c;
          },
          "bits"_a, "qjl"_a = false, "f32meta"_a = false)
      .def_prop_ro("format", [](const kvq::QuantConfig& c) { return std::string(format_name(c)); })
      .def_ro("bits", &kvq::QuantConfig::bits)
      .def_ro("symmetric", &kvq::QuantConfig::symmetric)
      .def_prop_ro("axis", [](const kvq::QuantConfig& c) { return std::string(kvq::to_string(c.axis)); })
      .def_ro("group", &kvq::QuantConfig::group)
      .def_prop_ro("meta", [](const kvq::QuantConfig& c) { return std::string(kvq::to_string(c.meta)); })
      .def_ro("fp8_margin", &kvq::QuantConfig::fp8_margin)
      .def_ro("fp4_tensor_scale", &kvq::QuantConfig::fp4_tensor_scale)
      .def_ro("qjl", &kvq::QuantConfig::qjl)
      .def_ro("rotate", &kvq::QuantConfig::rotate)
      .def_ro("outliers", &kvq::QuantConfig::outliers)
      .def_ro("outlier_pct", &kvq::QuantConfig::outlier_pct)
      .def_ro("nuq_ready", &kvq::QuantConfig::nuq_ready)
      .def_prop_ro("nuq_levels",
                   [](const kvq::QuantConfig& c) {
                     // The calibrated codebook (2^bits ascending levels); None before calibration.
                     std::optional<std::vector<float>> out;
                     if (c.format == kvq::Format::kNuq && c.nuq_ready)
                       out = std::vector<float>(c.nuq_levels.begin(),
                                                c.nuq_levels.begin() + (size_t{1} << c.bits));
                     return out;
                   })
      .def_ro("seed", &kvq::QuantConfig::seed)
      .def_prop_ro("name", &kvq::QuantConfig::name)
      .def_prop_ro("spec", [](const kvq::QuantConfig& c) { return kvq::config_spec(c); })
      .def("__eq__", [](const kvq::QuantConfig& a, const kvq::QuantConfig& b) {
        return kvq::same_config(a, b);
      })
      .def("__eq__", [](const kvq::QuantConfig&, nb::handle) { return false; })
      .def("__hash__", [](const kvq::QuantConfig& c) {
        return nb::hash(nb::str(kvq::config_spec(c).c_str()));
      })
      .def("__repr__",
           [](const kvq::QuantConfig& c) { return "QuantConfig('" + kvq::config_spec(c) + "')"; })
      .def("__str__", [](const kvq::QuantConfig& c) { return kvq::config_spec(c); });

  // ------------------------------------------------------------------------------ Policy
  nb::class_<kvq::Policy>(m, "Policy")
      .def(
          "__init__",
          [](kvq::Policy* self, const std::string& spec) {
            new (self) kvq::Policy(kvq::parse_policy(spec));
          },
          "spec"_a)
      .def_prop_ro("key", [](const kvq::Policy& p) { return p.key; })
      .def_prop_ro("value", [](const kvq::Policy& p) { return p.value; })
      .def_ro("residual", &kvq::Policy::residual)
      .def_ro("sinks", &kvq::Policy::sinks)
      .def_ro("skip_first", &kvq::Policy::skip_first)
      .def_ro("skip_last", &kvq::Policy::skip_last)
      .def_prop_ro("skip_config", [](const kvq::Policy& p) { return p.skip_config; })
      .def_prop_ro("overrides", [](const kvq::Policy& p) { return p.overrides; })
      .def_prop_ro("spec", &kvq::Policy::spec)
      .def("key_for", &kvq::Policy::key_for, "layer"_a, "n_layers"_a)
      .def("value_for", &kvq::Policy::value_for, "layer"_a, "n_layers"_a)
      .def("skips", &kvq::Policy::skips, "layer"_a, "n_layers"_a)
      .def("__eq__", [](const kvq::Policy& a, const kvq::Policy& b) { return a == b; })
      .def("__eq__", [](const kvq::Policy&, nb::handle) { return false; })
      .def("__hash__", [](const kvq::Policy& p) { return nb::hash(nb::str(p.spec().c_str())); })
      .def("__repr__", [](const kvq::Policy& p) { return "Policy('" + p.spec() + "')"; })
      .def("__str__", &kvq::Policy::spec);

  m.def(
      "parse_policy", [](const std::string& spec) { return kvq::parse_policy(spec); }, "spec"_a);
  m.def(
      "parse_policies", [](const std::string& specs) { return kvq::parse_policies(specs); },
      "specs"_a);
  m.def("presets", []() {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const kvq::Preset& p : kvq::policy_presets()) out.emplace_back(p.name, p.spec, p.description);
    return out;
  });

  // ------------------------------------------------------------------------------ accountant
  m.def(
      "account",
      [](nb::handle config, const std::vector<int64_t>& shape) {
        return breakdown_dict(
            kvq::account(config_from(config, "kvq.account"), shape_from(shape, "kvq.account")));
      },
      "config"_a, "shape"_a);
  m.def(
      "effective_bits",
      [](nb::handle config, const std::vector<int64_t>& shape) {
        return kvq::effective_bits(config_from(config, "kvq.effective_bits"),
                                   shape_from(shape, "kvq.effective_bits"));
      },
      "config"_a, "shape"_a);

  // ------------------------------------------------------------------------------ QTensor
  nb::class_<PyQTensor>(m, "QTensor")
      .def(nb::init<>())
      .def_prop_ro("config",
                   [](const PyQTensor& t) {
                     std::shared_lock<std::shared_mutex> lk(t.mu);
                     return t.q.config;
                   })
      .def_prop_ro("shape",
                   [](const PyQTensor& t) {
                     std::shared_lock<std::shared_mutex> lk(t.mu);
                     return std::make_tuple(t.q.shape.tokens, t.q.shape.heads, t.q.shape.head_dim);
                   })
      .def_prop_ro("nbytes",
                   [](const PyQTensor& t) {
                     std::shared_lock<std::shared_mutex> lk(t.mu);
                     return t.q.bytes();
                   })
      .def_prop_ro("effective_bits",
                   [](const PyQTensor& t) {
                     std::shared_lock<std::shared_mutex> lk(t.mu);
                     return t.q.effective_bits();
                   })
      .def("breakdown",
           [](const PyQTensor& t) {
             std::shared_lock<std::shared_mutex> lk(t.mu);
             return breakdown_dict(t.q.breakdown());
           })
      .def("buffers",
           [](const PyQTensor& t) {
             std::shared_lock<std::shared_mutex> lk(t.mu);
             nb::dict d;
             d["codes"] = to_bytes(t.q.codes.data(), t.q.codes.size());
             d["scales"] = to_bytes(t.q.scales.raw().data(), t.q.scales.bytes());
             d["zeros"] = to_bytes(t.q.zeros.raw().data(), t.q.zeros.bytes());
             d["norms"] = to_bytes(t.q.norms.raw().data(), t.q.norms.bytes());
             d["qjl_signs"] = to_bytes(t.q.qjl_signs.data(), t.q.qjl_signs.size());
             d["qjl_norms"] = to_bytes(t.q.qjl_norms.raw().data(), t.q.qjl_norms.bytes());
             // Dense-and-sparse (/out<k>): [tokens, heads, k] fp16 values and channel indices
             // (1 byte each, 2 little-endian when head_dim > 256); empty without outliers.
             d["outlier_values"] = to_bytes(t.q.outlier_values.data(), t.q.outlier_values.size());
             d["outlier_pos"] = to_bytes(t.q.outlier_pos.data(), t.q.outlier_pos.size());
             return d;
           })
      .def(
          "dequantize",
          [](const PyQTensor& t, nb::handle dtype, nb::handle out) -> nb::object {
            if (!out.is_none()) {
              dequantize_into(t, out);
              return nb::borrow(out);
            }
            return nb::cast(dequantize_to(t, out_dtype(dtype, "QTensor.dequantize")));
          },
          "dtype"_a = "float32", "out"_a = nb::none())
      .def("__repr__", [](const PyQTensor& t) {
        std::shared_lock<std::shared_mutex> lk(t.mu);
        char eb[32];
        std::snprintf(eb, sizeof eb, "%.4f", t.q.effective_bits());
        return kvq::detail::cat("QTensor('", kvq::config_spec(t.q.config), "', shape=(",
                                t.q.shape.tokens, ", ", t.q.shape.heads, ", ", t.q.shape.head_dim,
                                "), nbytes=", t.q.bytes(), ", effective_bits=", eb, ")");
      });

  m.def(
      "quantize",
      [](nb::handle x, nb::handle config, PyQTensor* out) -> nb::object {
        const kvq::QuantConfig cfg = config_from(config, "kvq.quantize");
        const InTensor t = as_tensor(x, "kvq.quantize", "x");
        nb::object result;
        PyQTensor* dst = nullptr;
        if (out != nullptr) {
          dst = out;
          result = nb::find(dst);
        } else {
          auto* fresh = new PyQTensor();
          recycler().take(fresh->q);
          result = nb::cast(fresh, nb::rv_policy::take_ownership);
          dst = fresh;
        }
        {
          nb::gil_scoped_release nogil;
          std::unique_lock<std::shared_mutex> lk(dst->mu);
          try {
            visit(t, [&](auto view) { kvq::quantize(cfg, view, dst->q); });
          } catch (...) {
            dst->q = kvq::QTensor();  // no half-written tensor is ever visible
            throw;
          }
        }
        return result;
      },
      "x"_a, "config"_a, nb::arg("out").none() = nb::none());

  // ------------------------------------------------------------------------------ KVCache
  nb::class_<kvq::MemoryReport>(m, "MemoryReport")
      .def_prop_ro("total", &kvq::MemoryReport::total)
      .def_ro("overhead", &kvq::MemoryReport::overhead)
      .def_prop_ro("scratch", [](const kvq::MemoryReport& r) { return scratch_of(r, 0); })
      .def_prop_ro("elements", &kvq::MemoryReport::elements)
      .def_prop_ro("effective_bits", &kvq::MemoryReport::effective_bits)
      .def_prop_ro("compression_vs_f16", &kvq::MemoryReport::compression_vs_f16)
      .def_ro("kv_heads", &kvq::MemoryReport::kv_heads)
      .def_ro("head_dim", &kvq::MemoryReport::head_dim)
      .def_prop_ro("keys", [](const kvq::MemoryReport& r) { return stream_dict(r.key_total()); })
      .def_prop_ro("values", [](const kvq::MemoryReport& r) { return stream_dict(r.value_total()); })
      .def_prop_ro("layers",
                   [](const kvq::MemoryReport& r) {
                     nb::list out;
                     for (const kvq::LayerMemory& l : r.layers) {
                       nb::dict d;
                       d["layer"] = l.layer;
                       d["tokens"] = l.tokens;
                       d["sink_tokens"] = l.sink_tokens;
                       d["packed_tokens"] = l.packed_tokens;
                       d["residual_tokens"] = l.residual_tokens;
                       d["blocks"] = l.blocks;
                       d["block_tokens"] = l.block_tokens;
                       d["key_config"] = l.key_config;
                       d["value_config"] = l.value_config;
                       d["keys"] = stream_dict(l.key);
                       d["values"] = stream_dict(l.value);
                       d["total"] = l.total();
                       out.append(d);
                     }
                     return out;
                   })
      .def("__str__", &kvq::MemoryReport::str)
      .def("__repr__", [](const kvq::MemoryReport& r) {
        char b[160];
        std::snprintf(b, sizeof b, "MemoryReport(total=%zu, effective_bits=%.4f, layers=%zu)",
                      r.total(), r.effective_bits(), r.layers.size());
        return std::string(b);
      });

  nb::class_<PyCache>(m, "KVCache")
      .def(
          "__init__",
          [](PyCache* self, nb::handle policy, int n_layers, int kv_heads, int head_dim,
             int max_tokens) {
            new (self) PyCache(policy_from(policy, "kvq.KVCache"), n_layers, kv_heads, head_dim,
                               max_tokens);
          },
          "policy"_a, "n_layers"_a, "kv_heads"_a, "head_dim"_a, "max_tokens"_a = 0)
      .def(
          "append",
          [](PyCache& c, int layer, nb::handle k, nb::handle v) {
            const InTensor kt = as_tensor(k, "KVCache.append", "k");
            const InTensor vt = as_tensor(v, "KVCache.append", "v");
            if (kt.dtype != vt.dtype)
              type_error(kvq::detail::cat("KVCache.append: k is ", kvq::to_string(kt.dtype),
                                          " but v is ", kvq::to_string(vt.dtype),
                                          "; give both in one dtype"));
            nb::gil_scoped_release nogil;
            std::unique_lock<std::shared_mutex> lk(c.mu);
            switch (kt.dtype) {
              case kvq::DType::kF32: c.cache.append(layer, kt.view<float>(), vt.view<float>()); break;
              case kvq::DType::kF16: c.cache.append(layer, kt.view<kvq::f16>(), vt.view<kvq::f16>()); break;
              case kvq::DType::kBF16: c.cache.append(layer, kt.view<kvq::bf16>(), vt.view<kvq::bf16>()); break;
            }
          },
          "layer"_a, "k"_a, "v"_a)
      .def(
          "read",
          [](const PyCache& c, int layer, int64_t begin, std::optional<int64_t> end) {
            // Everything is validated before the output arrays are allocated: a bad layer or an
            // end past the stored tokens is a kvq.Error, never a MemoryError from a huge array.
            int64_t e;
            {
              std::shared_lock<std::shared_mutex> lk(c.mu);
              KVQ_REQUIRE(layer >= 0 && layer < c.cache.n_layers(), kOutOfRange,
                          "KVCache.read: layer ", layer, " out of range [0, ", c.cache.n_layers(),
                          ")");
              const int64_t n = c.cache.tokens(layer);
              e = end ? *end : n;
              KVQ_REQUIRE(0 <= begin && begin <= e && e <= n, kOutOfRange, "KVCache.read: range [",
                          begin, ", ", e, ") is not within the ", n, " tokens of layer ", layer);
            }
            const kvq::Shape s{e - begin, c.cache.kv_heads(), c.cache.head_dim()};
            OutBuffer k = new_array(shape_vec(s), nb::dtype<float>());
            OutBuffer v = new_array(shape_vec(s), nb::dtype<float>());
            {
              nb::gil_scoped_release nogil;
              std::shared_lock<std::shared_mutex> lk(c.mu);
              c.cache.read(layer, begin, e, kvq::KVView<float>(static_cast<float*>(k.data), s),
                           kvq::KVView<float>(static_cast<float*>(v.data), s));
            }
            return std::make_pair(k.array, v.array);
          },
          "layer"_a, "begin"_a = 0, "end"_a = nb::none())
      .def(
          "attend",
          [](const PyCache& c, int layer, nb::handle q, bool causal, double scale, double softcap,
             int64_t window, std::optional<PosArray> positions, std::optional<MaskArray> mask,
             std::optional<SinkArray> sinks, int threads, int64_t split_tokens, bool return_lse,
             const std::string& dot) {
            const InTensor qt = as_tensor(q, "KVCache.attend", "q");
            int64_t T = 0;
            {
              std::shared_lock<std::shared_mutex> lk(c.mu);
              KVQ_REQUIRE(layer >= 0 && layer < c.cache.n_layers(), kOutOfRange,
                          "KVCache.attend: layer ", layer, " out of range [0, ",
                          c.cache.n_layers(), ")");
              T = c.cache.tokens(layer);
            }
            PyAttn a = attention_options("KVCache.attend", qt.shape.tokens, qt.shape.heads, T,
                                         scale, softcap, window, positions, mask, sinks, threads,
                                         split_tokens, return_lse, dot);
            OutBuffer o = new_array(shape_vec(qt.shape), nb::dtype<float>());
            {
              nb::gil_scoped_release nogil;
              std::vector<float> qf;
              const kvq::KVView<const float> qv = f32_queries(qt, qf);
              std::shared_lock<std::shared_mutex> lk(c.mu);
              KVQ_REQUIRE(c.cache.tokens(layer) == T || !a.opt.mask_bits, kShapeMismatch,
                          "KVCache.attend: layer ", layer, " changed while the mask was read");
              kvq::AttentionWorkspace ws;
              SharedWorkers::Lease workers(a.opt);
              kvq::attend(c.cache, layer, qv, kvq::KVView<float>(static_cast<float*>(o.data), qt.shape),
                          causal, ws, nullptr, a.opt);
            }
            return attention_result(o, a);
          },
          "layer"_a, "q"_a, "causal"_a = true, nb::kw_only(), "scale"_a = 0.0,
          "softcap"_a = 0.0, "window"_a = 0, nb::arg("positions").none() = nb::none(),
          nb::arg("mask").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
          "threads"_a = 1, "split_tokens"_a = 0, "return_lse"_a = false, "dot"_a = "exact")
      .def(
          "truncate",
          [](PyCache& c, int64_t n, std::optional<int> layer) {
            nb::gil_scoped_release nogil;
            std::unique_lock<std::shared_mutex> lk(c.mu);
            if (layer) {
              c.cache.truncate(*layer, n);
            } else {
              c.cache.truncate(n);
            }
          },
          "n"_a, "layer"_a = nb::none())
      .def("truncate_is_exact",
           [](const PyCache& c, int layer, int64_t n) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.truncate_is_exact(layer, n);
           },
           "layer"_a, "n"_a)
      .def("clear",
           [](PyCache& c) {
             nb::gil_scoped_release nogil;
             std::unique_lock<std::shared_mutex> lk(c.mu);
             c.cache.clear();
           })
      .def("tokens",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.tokens(layer);
           },
           "layer"_a = 0)
      .def("sink_tokens",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.sink_tokens(layer);
           },
           "layer"_a)
      .def("packed_tokens",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.packed_tokens(layer);
           },
           "layer"_a)
      .def("residual_tokens",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.residual_tokens(layer);
           },
           "layer"_a)
      .def("block_tokens",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.block_tokens(layer);
           },
           "layer"_a)
      .def("key_config",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.key_config(layer);
           },
           "layer"_a)
      .def("value_config",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.value_config(layer);
           },
           "layer"_a)
      .def("skipped",
           [](const PyCache& c, int layer) {
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.skipped(layer);
           },
           "layer"_a)
      .def("copy", [](const PyCache& c) { return copy_cache(c.cache, c); },
           nb::rv_policy::take_ownership)
      .def(
          "fork",
          [](const PyCache& c, std::optional<int64_t> n) {
            nb::gil_scoped_release nogil;
            std::shared_lock<std::shared_mutex> lk(c.mu);
            return new PyCache(n ? c.cache.fork(*n) : c.cache.fork());
          },
          nb::arg("n").none() = nb::none(), nb::rv_policy::take_ownership,
          "A cache sharing this one's pages (prefix sharing, docs/cache.md): fork() all tokens, "
          "fork(n) the first n of every layer. Appending to either never changes the other.")
      .def("__copy__", [](const PyCache& c) { return copy_cache(c.cache, c); },
           nb::rv_policy::take_ownership)
      .def("__deepcopy__", [](const PyCache& c, nb::handle) { return copy_cache(c.cache, c); },
           "memo"_a, nb::rv_policy::take_ownership)
      .def_prop_ro("policy", [](const PyCache& c) { return c.cache.policy(); })
      .def_prop_ro("n_layers", [](const PyCache& c) { return c.cache.n_layers(); })
      .def_prop_ro("kv_heads", [](const PyCache& c) { return c.cache.kv_heads(); })
      .def_prop_ro("head_dim", [](const PyCache& c) { return c.cache.head_dim(); })
      .def_prop_ro("max_tokens", [](const PyCache& c) { return c.cache.max_tokens(); })
      .def_prop_ro("nbytes",
                   [](const PyCache& c) {
                     std::shared_lock<std::shared_mutex> lk(c.mu);
                     return c.cache.memory_report().total();
                   })
      .def("memory_report",
           [](const PyCache& c) {
             nb::gil_scoped_release nogil;
             std::shared_lock<std::shared_mutex> lk(c.mu);
             return c.cache.memory_report();
           })
      .def("__repr__", [](const PyCache& c) {
        std::shared_lock<std::shared_mutex> lk(c.mu);
        return kvq::detail::cat("KVCache('", c.cache.policy().spec(), "', n_layers=",
                                c.cache.n_layers(), ", kv_heads=", c.cache.kv_heads(),
                                ", head_dim=", c.cache.head_dim(), ")");
      });

  // ------------------------------------------------------------------------------ KV dumps
  m.def(
      "load_kv_dump",
      [](const std::string& path) {
        kvq::io::KVDump dump;
        {
          nb::gil_scoped_release nogil;
          dump = kvq::io::load_kv_dump(path);
        }
        nb::list layers;
        for (const auto& l : dump.layers) {
          nb::dict d;
          d["k"] = from_io_array(l.k);
          d["v"] = from_io_array(l.v);
          if (l.q) d["q"] = from_io_array(*l.q);
          if (l.k_prerope) d["k_prerope"] = from_io_array(*l.k_prerope);
          layers.append(d);
        }
        return layers;
      },
      "path"_a);
  m.def(
      "save_kv_dump",
      [](const std::string& path, nb::handle layers, const std::string& format) {
        KVQ_REQUIRE(format == "safetensors" || format == "npy", kInvalidArgument,
                    "kvq.save_kv_dump: format must be 'safetensors' or 'npy', got '", format, "'");
        kvq::io::KVDump dump = dump_from_layers(layers, "kvq.save_kv_dump");
        nb::gil_scoped_release nogil;
        kvq::io::save_kv_dump(path, dump,
                              format == "npy" ? kvq::io::DumpFormat::kNpyDir
                                              : kvq::io::DumpFormat::kSafetensors);
      },
      "path"_a, "layers"_a, "format"_a = "safetensors");

  // ------------------------------------------------------------------------------ calibration
  // nuq codebooks (policy/calibrate.hpp): learned on a KV dump (a path or the layer dicts
  // save_kv_dump takes), returned as a calibrated Policy whose per-layer overrides carry them;
  // KVCache and policy.key_for(...) -> kvq.quantize accept it like any policy.
  m.def(
      "calibrate",
      [](nb::handle policy, nb::handle data, bool prerope_keys, const std::string& weights,
         int max_iterations, size_t max_samples) {
        const kvq::Policy p = policy_from(policy, "kvq.calibrate");
        KVQ_REQUIRE(weights == "sensitivity" || weights == "uniform", kInvalidArgument,
                    "kvq.calibrate: weights must be 'sensitivity' or 'uniform', got '", weights,
                    "'");
        KVQ_REQUIRE(max_iterations >= 1, kInvalidArgument,
                    "kvq.calibrate: max_iterations must be >= 1, got ", max_iterations);
        KVQ_REQUIRE(max_samples >= 1, kInvalidArgument,
                    "kvq.calibrate: max_samples must be >= 1, got ", max_samples);
        kvq::CalibrationOptions opt;
        opt.weights = weights == "uniform" ? kvq::CalibrationWeights::kUniform
                                           : kvq::CalibrationWeights::kSensitivity;
        opt.max_iterations = max_iterations;
        opt.max_samples = max_samples;
        kvq::io::KVDump dump;
        const bool is_path = nb::isinstance<nb::str>(data) ||
                             nb::hasattr(data, "__fspath__");
        std::string path;
        if (is_path) {
          path = nb::cast<std::string>(nb::str(nb::module_::import_("os").attr("fspath")(data)));
        } else {
          dump = dump_from_layers(data, "kvq.calibrate");
        }
        nb::gil_scoped_release nogil;
        if (is_path) dump = kvq::io::load_kv_dump(path);
        return kvq::calibrate(p, dump, prerope_keys, opt);
      },
      "policy"_a, "data"_a, nb::kw_only(), "prerope_keys"_a = false, "weights"_a = "sensitivity",
      "max_iterations"_a = 1000, "max_samples"_a = size_t{4} << 20);
  m.def(
      "needs_calibration",
      [](nb::handle policy, int n_layers) {
        return kvq::needs_calibration(policy_from(policy, "kvq.needs_calibration"), n_layers);
      },
      "policy"_a, "n_layers"_a);
  m.def(
      "save_calibration",
      [](const std::string& path, nb::handle policy, int n_layers, const std::string& source,
         const std::string& weights) {
        KVQ_REQUIRE(weights == "sensitivity" || weights == "uniform", kInvalidArgument,
                    "kvq.save_calibration: weights must be 'sensitivity' or 'uniform', got '",
                    weights, "'");
        const kvq::Policy p = policy_from(policy, "kvq.save_calibration");
        nb::gil_scoped_release nogil;
        kvq::save_calibration(path, p, n_layers, source,
                              weights == "uniform" ? kvq::CalibrationWeights::kUniform
                                                   : kvq::CalibrationWeights::kSensitivity);
      },
      "path"_a, "policy"_a, "n_layers"_a, "source"_a = "", "weights"_a = "sensitivity");
  m.def(
      "load_calibration",
      [](const std::string& path, nb::handle policy, int n_layers) {
        const kvq::Policy p = policy_from(policy, "kvq.load_calibration");
        nb::gil_scoped_release nogil;
        return kvq::apply_calibration(p, kvq::load_calibration(path), n_layers);
      },
      "path"_a, "policy"_a, "n_layers"_a);
}
