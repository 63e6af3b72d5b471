// Error handling for the standalone CUDA drivers in tools/: a failed CUDA call ends the program
// with its location, so a driver never reports results computed after an error.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    cudaError_t status_ = (expr);                                        \
    if (status_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(status_));                         \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)
