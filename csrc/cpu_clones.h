// FASTCKPT_CPU_CLONES marks a CPU hot loop to be built for baseline x86-64, AVX2 (x86-64-v3) and
// AVX-512 (x86-64-v4); the dynamic loader picks the best one for the machine (GNU ifunc), so the
// extension's compile flags stay portable. Helpers called inside must be inlined into it (a helper
// left out of line runs as baseline code).
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FASTCKPT_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define FASTCKPT_CPU_CLONES
#endif
