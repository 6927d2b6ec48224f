// A small C++ stand-in for the Metal language features the fused-MoE kernels use, so that the
// Metal prelude and the shared bodies compile with g++ in CI (a typo only a Mac would see fails
// here) and can run on the CPU against the reference. It is not Metal: address-space qualifiers
// are erased, threadgroup memory is a function-local static (so threadgroups run one at a time), and
// a simdgroup is 32 std::threads meeting at a barrier in simd_sum/max/min.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

using mb_std_thread = std::thread;  // named before `thread` becomes an (erased) address-space qualifier

#define MB_UNROLL _Pragma("GCC unroll 16")  // metal_header.h's, in g++'s words

#define device
#define constant
#define thread
#define threadgroup static  // shared by every thread of the (one running) threadgroup

using uint = uint32_t;
using ushort = unsigned short;
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; };
struct float4 { float x, y, z, w; };

// bfloat16 storage with the conversions MLX's Metal bfloat16_t offers (round to nearest even).
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <typename To, typename From>
To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

// One simdgroup: the 32 lanes meet at the barrier to exchange their values.
struct MbSimdgroup {
  std::barrier<> meet{32};
  uint32_t values[32];
};
inline thread_local MbSimdgroup* mb_shim_group = nullptr;
inline thread_local uint mb_shim_lane = 0;
// Every thread of the launch (one simdgroup, or one threadgroup of several) meets here.
inline thread_local std::barrier<>* mb_shim_threadgroup = nullptr;

// Every lane gets op folded over the 32 lanes' values in lane order.
template <typename V, typename Op>
V mb_shim_reduce(V v, Op op) {
  MbSimdgroup& g = *mb_shim_group;
  g.values[mb_shim_lane] = as_type<uint32_t>(v);
  g.meet.arrive_and_wait();
  V acc = as_type<V>(g.values[0]);
  for (int i = 1; i < 32; ++i) acc = op(acc, as_type<V>(g.values[i]));
  g.meet.arrive_and_wait();  // nobody overwrites values before every lane has read them
  return acc;
}

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
// Metal's atomic_uint over a uint32_t buffer: threadgroups run one after another here, so a plain atomic add of
// the lanes' threads is all the ordering there is to emulate.
struct atomic_uint {
  uint32_t value;
};
enum memory_order { memory_order_relaxed };
inline uint32_t atomic_fetch_add_explicit(atomic_uint* object, uint32_t operand, memory_order) {
  return std::atomic_ref<uint32_t>(object->value).fetch_add(operand);
}
inline void threadgroup_barrier(mem_flags) { mb_shim_threadgroup->arrive_and_wait(); }
inline float exp(float v) { return std::exp(v); }
namespace precise {
inline float cos(float v) { return std::cos(v); }
inline float log(float v) { return std::log(v); }
inline float sin(float v) { return std::sin(v); }
inline float sqrt(float v) { return std::sqrt(v); }
}  // namespace precise
inline float simd_sum(float v) { return mb_shim_reduce(v, [](float a, float b) { return a + b; }); }
inline float simd_max(float v) { return mb_shim_reduce(v, [](float a, float b) { return std::fmax(a, b); }); }
inline uint32_t simd_min(uint32_t v) { return mb_shim_reduce(v, [](uint32_t a, uint32_t b) { return a < b ? a : b; }); }
inline float simd_shuffle_xor(float v, unsigned short mask) {
  MbSimdgroup& g = *mb_shim_group;
  g.values[mb_shim_lane] = as_type<uint32_t>(v);
  g.meet.arrive_and_wait();
  const float other = as_type<float>(g.values[mb_shim_lane ^ mask]);
  g.meet.arrive_and_wait();
  return other;
}
}  // namespace metal

// Run `kernel(thread_position_in_grid)` over a (32, rows, slots) grid: 32 lane threads walk the
// simdgroups in the same order, so every simd_sum meets all 32 lanes of the same row.
template <typename Kernel>
void mb_shim_launch(uint rows, uint slots, Kernel kernel) {
  MbSimdgroup group;
  std::vector<mb_std_thread> lanes;
  for (uint lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&group, &kernel, lane, rows, slots] {
      mb_shim_group = &group;
      mb_shim_lane = lane;
      mb_shim_threadgroup = &group.meet;
      for (uint z = 0; z < slots; ++z)
        for (uint y = 0; y < rows; ++y) kernel(uint3{lane, y, z});
    });
  }
  for (auto& t : lanes) t.join();
}

// Run `kernel(thread_position_in_grid)` over `groups` threadgroups of `rows` simdgroups each, one
// threadgroup at a time with all its threads at once, so the kernel may meet at threadgroup_barrier.
template <typename Kernel>
void mb_shim_launch_threadgroups(uint groups, uint rows, Kernel kernel) {
  for (uint first = 0; first < groups * rows; first += rows) {
    std::vector<MbSimdgroup> simdgroups(rows);
    std::barrier<> all(32 * rows);
    std::vector<mb_std_thread> threads;
    for (uint row = 0; row < rows; ++row) {
      for (uint lane = 0; lane < 32; ++lane) {
        threads.emplace_back([&simdgroups, &all, &kernel, lane, row, first] {
          mb_shim_group = &simdgroups[row];
          mb_shim_lane = lane;
          mb_shim_threadgroup = &all;
          kernel(uint3{lane, first + row, 0});
        });
      }
    }
    for (auto& t : threads) t.join();
  }
}
