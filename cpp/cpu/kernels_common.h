// Everything flash_impl.h needs from outside, included by each kernels_<isa>.cc before it opens its
// namespace (flash_impl.h itself is included inside that namespace and so cannot include headers).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/params.h"
#include "cpu/attention_cpu.h"
#include "cpu/half.h"
#include "cpu/kernels.h"
