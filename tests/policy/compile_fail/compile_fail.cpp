// Compile-time policy misuse must fail to compile with the static_assert that says why.
// tests/CMakeLists.txt compiles this file once per KVQ_CASE (-fsyntax-only) and checks the
// compiler's message; case 0 must compile (a control: the include path and the good form work).
#include "kvq/policy/policy.hpp"

using namespace kvq;

#if KVQ_CASE == 0
using P = KVPolicy<Int<2, PerChannel, 32>, Int<2, PerToken, 32>, Residual<128>, SkipLayers<1, 2>>;
#elif KVQ_CASE == 1
using P = KVPolicy<Int<5, PerChannel, 32>, Int<2>>;  // 5-bit ints do not exist
#elif KVQ_CASE == 2
using P = KVPolicy<Fp8E4M3<PerChannel>, Int<4>>;  // fp8 has no per-channel scales
#elif KVQ_CASE == 3
using P = KVPolicy<LloydMax<3>, LloydMax<3, true>>;  // QJL on values
#elif KVQ_CASE == 4
using P = KVPolicy<Int<2>, Int<2>, Residual<32>, Residual<64>>;  // an option twice
#elif KVQ_CASE == 5
using P = KVPolicy<Int<2>, float>;  // not a quantizer tag
#elif KVQ_CASE == 6
using P = KVPolicy<Int<2>, Int<2>, LayerOverride<1, Int<8>, Int<8>>, LayerOverride<1, Int<4>, Int<4>>>;
#endif

int main() { return P::policy().residual >= 0 ? 0 : 1; }
