// XLA FFI handlers for the CPU kernels: decode buffers, build params, run on XLA's thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "cpu/attention_cpu.h"
#include "cpu/decode_cpu.h"
#include "ffi/decode_shapes.h"
#include "ffi/handlers.h"
#include "ffi/shapes.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_glue {
namespace {

namespace ffi = xla::ffi;

// Shared between the calling thread and the helpers it schedules. Helpers may start after the
// call has returned (the pool is busy elsewhere), so the state is reference counted and a late
// helper finds no index left and never touches `task`.
struct ParallelState {
  std::atomic<int64_t> next{0};
  int64_t n_tasks = 0;
  const std::function<void(int64_t)>* task = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  int64_t finished = 0;

  void drain() {
    int64_t ran = 0;
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      (*task)(i);
      ++ran;
    }
    if (ran > 0) {
      std::lock_guard<std::mutex> lock(mu);
      finished += ran;
      if (finished == n_tasks) cv.notify_all();
    }
  }
};

// The calling thread works through the tasks too, so the call completes even when no pool thread
// is free; waiting is only for tasks that helpers have already claimed. It counts as one of the
// pool's threads: XLA:CPU runs the custom call on the thread that executes the program (the
// caller's, or one of the pool's own), so num_threads() - 1 helpers keep exactly num_threads()
// threads busy either way. Scheduling num_threads() helpers as well put one thread more than
// there are cores to work, which then time-shared the cores and their caches.
cpu::ParallelFor make_parallel_for(ffi::ThreadPool& pool) {
  return [&pool](int64_t n_tasks, const std::function<void(int64_t)>& task) {
    if (n_tasks <= 0) return;
    auto state = std::make_shared<ParallelState>();
    state->n_tasks = n_tasks;
    state->task = &task;
    const int64_t helpers =
        std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, n_tasks - 1));
    for (int64_t i = 0; i < helpers; ++i) {
      pool.Schedule([state] { state->drain(); });
    }
    state->drain();
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->finished == state->n_tasks; });
  };
}

// A JAX_FLASH_CPU_ISA that names an unknown level, or one this CPU lacks, fails every call with
// its message instead of running other code than the one asked for (or crashing on an illegal
// instruction).
std::optional<ffi::Error> isa_refused() {
  const cpu::IsaChoice& choice = cpu::isa_choice();
  if (choice.error.empty()) return std::nullopt;
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, choice.error);
}

ffi::Error fwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::RemainingArgs extras, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> lse, ffi::Dictionary attrs) {
  auto call = decode_fwd(q, k, v, extras, *o, *lse, attrs);
  if (call.has_error()) return call.error();
  if (auto refused = isa_refused()) return *refused;
  cpu::attention_fwd(call->params, call->dtype, make_parallel_for(pool));
  return ffi::Error::Success();
}

ffi::Error bwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer delta,
                   ffi::RemainingArgs extras, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Dictionary attrs) {
  auto call = decode_bwd(q, k, v, dout, lse, delta, extras, *dq, *dk, *dv, attrs);
  if (call.has_error()) return call.error();
  if (auto refused = isa_refused()) return *refused;
  cpu::attention_bwd(call->params, call->dtype, make_parallel_for(pool));
  return ffi::Error::Success();
}

ffi::Error decode_cpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                      ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> partial_o,
                      ffi::Result<ffi::AnyBuffer> partial_lse, ffi::Dictionary attrs) {
  auto call = read_decode_call(q, k, v, cache_seqlens, block_table, sinks, *o, *lse, *partial_o,
                               *partial_lse, attrs);
  if (call.has_error()) return call.error();
  cpu::decode_fwd(call->params, call->dtype, make_parallel_for(pool));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::ffi_glue::fwd_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q   [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k   [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // v   [..., Sk, Hkv, D]
                                  .RemainingArgs()  // the optional inputs, ffi/shapes.h Extra
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // lse [..., Hq, Sq]
                                  .Attrs<xla::ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::ffi_glue::bwd_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q     [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k     [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // v     [..., Sk, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // dout  [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // lse   [..., Hq, Sq]
                                  .Arg<xla::ffi::AnyBuffer>()  // delta [..., Hq, Sq]
                                  .RemainingArgs()  // the optional inputs, ffi/shapes.h Extra
                                  .Ret<xla::ffi::AnyBuffer>()  // dq    [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // dk    [..., Sk, Hkv, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // dv    [..., Sk, Hkv, D]
                                  .Attrs<xla::ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashDecodeCpu, jax_flash::ffi_glue::decode_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q   [..., Sq, Hq, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // k_cache (ffi/decode_shapes.h)
                                  .Arg<xla::ffi::AnyBuffer>()  // v_cache, k_cache's shape
                                  .Arg<xla::ffi::AnyBuffer>()  // cache_seqlens int32 [...]
                                  .Arg<xla::ffi::AnyBuffer>()  // block_table int32 [..., pages]
                                  .Arg<xla::ffi::AnyBuffer>()  // sinks [..., Hq] or placeholder
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., Sq, Hq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // lse [..., Hq, Sq]
                                  .Ret<xla::ffi::AnyBuffer>()  // partial_o [..., n, Hq, Sq, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // partial_lse [..., n, Hq, Sq]
                                  .Attrs<xla::ffi::Dictionary>());
