// A `ccl` backend for torch.distributed on CPU tensors, over oneCCL from PyPI (oneccl-cpu).
//
// Built and loaded by helpers/launching/oneccl/__init__.py (torch.utils.cpp_extension), which
// registers `create` with torch.distributed.Backend.register_backend("ccl", ..., extended_api=True).
//
// Bootstrap: every rank first checks in on the process group's c10d Store (a bounded wait, so a
// rank that never comes is an error within the group's timeout); rank 0 then opens oneCCL's main
// key-value store and publishes its address on the same c10d Store; the others read it there and
// join. No side files, no ports of ours (oneCCL's key-value store listens on its own).
//
// Completion is synchronous: each collective is issued, then its oneCCL event is polled until it
// completes or the timeout passes; the Work returned is already complete. A collective whose peer
// never answers raises c10::DistBackendError after the timeout, and the backend refuses every later
// collective (oneCCL has no way to cancel an operation in flight; its buffers are kept alive).

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <pybind11/chrono.h>

#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace workshop_ccl {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

[[noreturn]] void fail(const std::string& msg) {
  C10_THROW_ERROR(DistBackendError, "ccl backend: " + msg);
}

std::string seconds_text(Millis timeout) {
  std::ostringstream s;
  s << (timeout.count() / 1000.0) << " s";
  return s.str();
}

ccl::datatype to_ccl(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ccl::datatype::float32;
    case at::kDouble:
      return ccl::datatype::float64;
    case at::kBFloat16:
      return ccl::datatype::bfloat16;
    case at::kHalf:
      return ccl::datatype::float16;
    case at::kInt:
      return ccl::datatype::int32;
    case at::kLong:
      return ccl::datatype::int64;
    case at::kShort:
      return ccl::datatype::int16;
    case at::kChar:
      return ccl::datatype::int8;
    case at::kByte:
      return ccl::datatype::uint8;
    default:
      fail(std::string("dtype ") + c10::toString(t) +
           " is not supported (float32, float64, bfloat16, float16, int8, uint8, int16, int32, int64 are)");
  }
}

void check_tensor(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu()) {
    fail(std::string(what) + " is on " + t.device().str() + ": this backend handles CPU tensors only");
  }
  if (!t.is_contiguous()) {
    fail(std::string(what) + " is not contiguous: pass tensor.contiguous()");
  }
  if (t.is_sparse()) {
    fail(std::string(what) + " is sparse: this backend handles dense tensors only");
  }
  to_ccl(t.scalar_type());
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  if (a.scalar_type() != b.scalar_type()) {
    fail(std::string(what) + ": input and output dtypes differ");
  }
}

// Synchronous Work: the collective has finished when this is created.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType op, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, op), outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(Millis /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What a helper thread creating the communicator hands back (shared, so a timed-out wait can leave).
struct CommSlot {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::unique_ptr<ccl::communicator> comm;
  std::string error;
};

class ProcessGroupCCL : public c10d::Backend {
 public:
  ProcessGroupCCL(const c10::intrusive_ptr<c10d::Store>& store,
                  int rank,
                  int size,
                  Millis timeout,
                  const std::string& group_id)
      : c10d::Backend(rank, size), timeout_(timeout), group_id_(group_id) {
    static std::once_flag init_once;
    std::call_once(init_once, [] { ccl::init(); });
    const auto deadline = Clock::now() + timeout_;
    // Keys of this creation only: a group made again on the same Store (same name) must not read
    // the previous one's count or address. Ranks create groups in the same order, so they agree.
    const std::string prefix =
        "ccl/" + std::to_string(store->add("ccl/created_by_rank_" + std::to_string(rank), 1)) + "/";
    check_in(store, prefix + "joined", deadline);

    // Rank 0 opens oneCCL's main key-value store; its address travels through the c10d Store.
    std::shared_ptr<ccl::kvs> kvs;
    const std::string key = prefix + "kvs_address";
    try {
      if (rank == 0) {
        kvs = ccl::create_main_kvs();
        auto addr = kvs->get_address();
        store->set(key, std::vector<uint8_t>(addr.begin(), addr.end()));
      } else {
        c10d::StoreTimeoutGuard guard(*store, remaining(deadline));
        auto bytes = store->get(key);
        ccl::kvs::address_type addr{};
        if (bytes.size() != addr.size()) {
          fail("the key-value store address from rank 0 has " + std::to_string(bytes.size()) +
               " bytes, expected " + std::to_string(addr.size()));
        }
        std::copy(bytes.begin(), bytes.end(), addr.begin());
        kvs = ccl::create_kvs(addr);
      }
    } catch (const ccl::exception& e) {
      fail(std::string("oneCCL's key-value store failed: ") + e.what());
    }

    // create_communicator blocks until every rank has joined: on a helper thread, with a deadline.
    auto slot = std::make_shared<CommSlot>();
    std::thread([slot, kvs, rank, size] {
      std::unique_ptr<ccl::communicator> comm;
      std::string error;
      try {
        comm = std::make_unique<ccl::communicator>(ccl::create_communicator(size, rank, kvs));
      } catch (const std::exception& e) {
        error = e.what();
      }
      std::lock_guard<std::mutex> lock(slot->mutex);
      slot->comm = std::move(comm);
      slot->error = error.empty() && !slot->comm ? "unknown error" : error;
      slot->done = true;
      slot->cv.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lock(slot->mutex);
    if (!slot->cv.wait_until(lock, deadline, [&] { return slot->done; })) {
      fail("rank " + std::to_string(rank) + ": oneCCL's communicator was not created within " +
           seconds_text(timeout_) + " (a rank stopped while joining?)");
    }
    if (!slot->comm) {
      fail("oneCCL could not create the communicator: " + slot->error);
    }
    comm_ = std::move(slot->comm);
    kvs_ = kvs;
  }

  ~ProcessGroupCCL() override {
    // A communicator with an operation that never completed cannot be destroyed safely: keep it.
    if (broken_) {
      (void)comm_.release();
    }
  }

  const std::string getBackendName() const override { return "ccl"; }

  void setTimeout(Millis timeout) override { timeout_ = timeout; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    for (auto& t : tensors) {
      check_tensor(t, "allreduce's tensor");
      auto [red, average] = to_reduction(opts.reduceOp, t.scalar_type());
      run("allreduce", opts.timeout, {t}, [&] {
        return ccl::allreduce(t.data_ptr(), t.data_ptr(), t.numel(), to_ccl(t.scalar_type()), red, *comm_);
      });
      if (average) {
        t.div_(getSize());
      }
    }
    return done(c10d::OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return allreduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    // All-reduce into a scratch copy; only the root keeps the result (as torch's reduce).
    for (auto& t : tensors) {
      check_tensor(t, "reduce's tensor");
      auto [red, average] = to_reduction(opts.reduceOp, t.scalar_type());
      at::Tensor scratch = t.clone();
      run("reduce", opts.timeout, {scratch}, [&] {
        return ccl::allreduce(scratch.data_ptr(), scratch.data_ptr(), scratch.numel(),
                              to_ccl(scratch.scalar_type()), red, *comm_);
      });
      if (getRank() == opts.rootRank) {
        t.copy_(average ? scratch.div_(getSize()) : scratch);
      }
    }
    return done(c10d::OpType::REDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    for (auto& t : tensors) {
      check_tensor(t, "broadcast's tensor");
      run("broadcast", opts.timeout, {t}, [&] {
        return ccl::broadcast(t.data_ptr(), t.numel(), to_ccl(t.scalar_type()),
                              static_cast<int>(opts.rootRank), *comm_);
      });
    }
    return done(c10d::OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    run("barrier", opts.timeout, {}, [&] { return ccl::barrier(*comm_); });
    return done(c10d::OpType::BARRIER, {});
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output,
                                                 at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    check_tensor(input, "all_gather_into_tensor's input");
    check_tensor(output, "all_gather_into_tensor's output");
    check_same(input, output, "all_gather_into_tensor");
    if (output.numel() != input.numel() * getSize()) {
      fail("all_gather_into_tensor: the output must have world_size x the input's elements");
    }
    run("all_gather_into_tensor", opts.timeout, {input, output}, [&] {
      return ccl::allgather(input.data_ptr(), output.data_ptr(), input.numel(),
                            to_ccl(input.scalar_type()), *comm_);
    });
    return done(c10d::OpType::_ALLGATHER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      fail("all_gather takes one input tensor and one list of outputs");
    }
    auto& input = inputs[0];
    auto& list = outputs[0];
    check_tensor(input, "all_gather's input");
    if (static_cast<int>(list.size()) != getSize()) {
      fail("all_gather: the output list must hold world_size tensors");
    }
    for (auto& o : list) {
      if (o.numel() != input.numel() || o.scalar_type() != input.scalar_type()) {
        fail("all_gather: every output must have the input's size and dtype");
      }
    }
    at::Tensor flat = at::empty({input.numel() * getSize()}, input.options());
    run("all_gather", opts.timeout, {input, flat}, [&] {
      return ccl::allgather(input.data_ptr(), flat.data_ptr(), input.numel(), to_ccl(input.scalar_type()),
                            *comm_);
    });
    for (int r = 0; r < getSize(); ++r) {
      list[r].copy_(flat.narrow(0, r * input.numel(), input.numel()).view(list[r].sizes()));
    }
    return done(c10d::OpType::ALLGATHER, list);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output,
                                                      at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    check_tensor(input, "reduce_scatter_tensor's input");
    check_tensor(output, "reduce_scatter_tensor's output");
    check_same(input, output, "reduce_scatter_tensor");
    if (input.numel() != output.numel() * getSize()) {
      fail("reduce_scatter_tensor: the input must have world_size x the output's elements");
    }
    auto [red, average] = to_reduction(opts.reduceOp, output.scalar_type());
    run("reduce_scatter_tensor", opts.timeout, {input, output}, [&] {
      return ccl::reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                 to_ccl(output.scalar_type()), red, *comm_);
    });
    if (average) {
      output.div_(getSize());
    }
    return done(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      fail("reduce_scatter takes one output tensor and one list of inputs");
    }
    auto& output = outputs[0];
    auto& list = inputs[0];
    if (static_cast<int>(list.size()) != getSize()) {
      fail("reduce_scatter: the input list must hold world_size tensors");
    }
    std::vector<at::Tensor> flat_parts;
    for (auto& t : list) {
      if (t.numel() != output.numel() || t.scalar_type() != output.scalar_type()) {
        fail("reduce_scatter: every input must have the output's size and dtype");
      }
      flat_parts.push_back(t.reshape({-1}));
    }
    at::Tensor flat = at::cat(flat_parts);
    return _reduce_scatter_base(output, flat, opts);
  }

 private:
  // Every rank adds itself to a counter on the Store, then waits (bounded) for all of them.
  void check_in(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, Clock::time_point deadline) {
    int64_t joined = store->add(key, 1);
    auto pause = Millis(1);
    while (joined < getSize()) {
      if (Clock::now() >= deadline) {
        fail("rank " + std::to_string(getRank()) + ": only " + std::to_string(joined) + " of " +
             std::to_string(getSize()) + " ranks joined process group '" + group_id_ + "' within " +
             seconds_text(timeout_) + ": a rank did not start or failed before init_process_group");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, Millis(50));
      joined = store->add(key, 0);
    }
  }

  static Millis remaining(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    return std::max(left, Millis(1));
  }

  std::pair<ccl::reduction, bool> to_reduction(const c10d::ReduceOp& op, at::ScalarType t) const {
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
        return {ccl::reduction::sum, false};
      case c10d::ReduceOp::AVG:
        if (!at::isFloatingType(t)) {
          fail("ReduceOp.AVG needs a floating-point tensor");
        }
        return {ccl::reduction::sum, true};  // the sum, then divided by the world size
      case c10d::ReduceOp::PRODUCT:
        return {ccl::reduction::prod, false};
      case c10d::ReduceOp::MIN:
        return {ccl::reduction::min, false};
      case c10d::ReduceOp::MAX:
        return {ccl::reduction::max, false};
      default:
        fail("reduce op not supported (SUM, AVG, PRODUCT, MIN, MAX are)");
    }
  }

  // Issue one oneCCL operation and wait for it, at most the timeout.
  template <typename Issue>
  void run(const char* name, Millis op_timeout, std::vector<at::Tensor> keep, Issue issue) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) {
      fail(std::string(name) + " refused: " + *broken_);
    }
    const Millis timeout = op_timeout == c10d::kUnsetTimeout ? timeout_ : op_timeout;
    const auto start = Clock::now();
    const auto deadline = start + timeout;
    ccl::event event;
    try {
      event = issue();
      size_t polls = 0;
      while (!event.test()) {
        if (Clock::now() >= deadline) {
          std::string why = std::string(name) + " on rank " + std::to_string(getRank()) + " of " +
                            std::to_string(getSize()) + " did not complete within " + seconds_text(timeout) +
                            ": a peer rank stopped, hangs, or called another collective";
          broken_ = why + " (earlier; destroy this process group)";
          abandon(std::move(event), keep);
          fail(why);
        }
        // Spin briefly (small messages complete in tens of microseconds), then yield, then sleep.
        ++polls;
        if (polls > 2000) {
          std::this_thread::sleep_for(std::chrono::microseconds(polls > 20000 ? 1000 : 50));
        } else if (polls > 200) {
          std::this_thread::yield();
        }
      }
    } catch (const ccl::exception& e) {
      fail(std::string(name) + " failed in oneCCL: " + e.what());
    }
  }

  // An operation that never completed: its event waits for it when destroyed, and oneCCL may still
  // write its buffers, so both are kept, never destroyed (nor is the communicator, see the destructor).
  static void abandon(ccl::event&& event, const std::vector<at::Tensor>& buffers) {
    static auto* events = new std::vector<ccl::event>();
    static auto* tensors = new std::vector<at::Tensor>();
    events->push_back(std::move(event));
    tensors->insert(tensors->end(), buffers.begin(), buffers.end());
  }

  c10::intrusive_ptr<c10d::Work> done(c10d::OpType op, std::vector<at::Tensor> outputs) {
    return c10::make_intrusive<CompletedWork>(getRank(), op, std::move(outputs));
  }

  Millis timeout_;
  std::string group_id_;
  std::shared_ptr<ccl::kvs> kvs_;
  std::unique_ptr<ccl::communicator> comm_;
  std::mutex mutex_;
  std::optional<std::string> broken_;
};

c10::intrusive_ptr<c10d::Backend> create(const c10::intrusive_ptr<c10d::Store>& store,
                                         int rank,
                                         int size,
                                         Millis timeout,
                                         const std::string& group_id) {
  return c10::make_intrusive<ProcessGroupCCL>(store, rank, size, timeout, group_id);
}

std::string oneccl_version() {
  auto v = ccl::get_library_version();
  return v.full;
}

}  // namespace workshop_ccl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::module_::import("torch.distributed");  // registers c10d.Backend and c10d.Store with pybind
  pybind11::class_<workshop_ccl::ProcessGroupCCL, c10d::Backend, c10::intrusive_ptr<workshop_ccl::ProcessGroupCCL>>(
      m, "ProcessGroupCCL");
  m.def("create", &workshop_ccl::create, pybind11::arg("store"), pybind11::arg("rank"), pybind11::arg("size"),
        pybind11::arg("timeout"), pybind11::arg("group_id"),
        "A ccl backend for one process group (the creator torch.distributed calls).",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("oneccl_version", &workshop_ccl::oneccl_version, "oneCCL's full version string.");
}
