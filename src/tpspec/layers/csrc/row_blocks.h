// The work split shared by tpspec's weight-only products (q4_1_linear.cpp, q8_0_linear.cpp).
#pragma once
#include <ATen/Parallel.h>

#include <type_traits>

// Calls block(rows, r0, o0, o1) over outputs split between threads (16 at least each) and rows in
// blocks of up to 8, the block's row count as a compile-time constant (std::integral_constant), so
// that each weight group widened once serves every row of the block.
template <typename Block>
static void for_row_blocks(int64_t R, int64_t O, Block&& block) {
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
    int64_t r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) block(std::integral_constant<int, 8>{}, r0, o0, o1);
    switch (R - r0) {
      case 7: block(std::integral_constant<int, 7>{}, r0, o0, o1); break;
      case 6: block(std::integral_constant<int, 6>{}, r0, o0, o1); break;
      case 5: block(std::integral_constant<int, 5>{}, r0, o0, o1); break;
      case 4: block(std::integral_constant<int, 4>{}, r0, o0, o1); break;
      case 3: block(std::integral_constant<int, 3>{}, r0, o0, o1); break;
      case 2: block(std::integral_constant<int, 2>{}, r0, o0, o1); break;
      case 1: block(std::integral_constant<int, 1>{}, r0, o0, o1); break;
    }
  });
}
