// Python bindings for the batching core: pyserver._core (re-exported by pyserver.batching).
// Blocking calls release the GIL and take only plain arguments; results are copied into Python
// objects after the GIL is re-acquired.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "batch_queue.h"

namespace py = pybind11;
using namespace streambatch;

namespace {

constexpr double kNsPerSecond = 1e9;

Nanos seconds_to_ns(double seconds) {
  if (!(seconds >= 0.0)) throw py::value_error("timeout must be a number of seconds >= 0");
  if (seconds > 1e9) return std::numeric_limits<Nanos>::max();
  return static_cast<Nanos>(seconds * kNsPerSecond);
}

// push() is the hot call: returning a pre-built enum object (an incref) instead of casting a
// new one each time is most of the difference between ~0.3 and ~1.5 microseconds per push.
std::vector<py::object>& status_objects() {
  static auto* objects = new std::vector<py::object>();  // leaked: outlives interpreter teardown
  return *objects;
}

py::object push_or_raise(BatchQueue& q, RequestId id, std::int64_t prompt_tokens,
                         std::int64_t max_new_tokens, int priority, Nanos deadline_ns) {
  PushResult r = q.push(id, prompt_tokens, max_new_tokens, priority, deadline_ns);
  if (r.status == PushStatus::kInvalid) throw py::value_error(r.reason);
  return status_objects()[static_cast<size_t>(r.status)];
}

// The hot path: push(id, prompt_tokens, max_new_tokens[, priority[, deadline_ns]]) with plain
// positional ints, as a METH_FASTCALL method. pybind11's generic dispatcher (argument vector,
// casters, overload walk) costs several times the queue operation itself; this entry converts
// the ints directly and hands anything else (keywords, non-ints, out-of-range values) to the
// checked pybind11 overloads in `_push`, which raise the precise ValueError.
PyObject* slow_push(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  py::object checked = py::reinterpret_borrow<py::object>(self).attr("_push");
  return PyObject_Vectorcall(checked.ptr(), args, static_cast<size_t>(nargs), kwnames);
}

PyObject* fast_push(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (kwnames != nullptr || nargs < 3 || nargs > 5) return slow_push(self, args, nargs, kwnames);
  std::int64_t v[5] = {0, 0, 0, 0, 0};
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (!PyLong_CheckExact(args[i])) return slow_push(self, args, nargs, kwnames);
    int overflow = 0;
    v[i] = PyLong_AsLongLongAndOverflow(args[i], &overflow);
    if (overflow != 0) return slow_push(self, args, nargs, kwnames);
  }
  if (v[3] < INT32_MIN || v[3] > INT32_MAX) return slow_push(self, args, nargs, kwnames);
  BatchQueue* q = nullptr;
  try {
    q = py::cast<BatchQueue*>(py::handle(self));
  } catch (const py::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "push() needs a BatchQueue");
    return nullptr;
  }
  PushResult r = q->push(v[0], v[1], v[2], static_cast<int>(v[3]), v[4]);
  if (r.status == PushStatus::kInvalid) {
    PyErr_SetString(PyExc_ValueError, r.reason.c_str());
    return nullptr;
  }
  return status_objects()[static_cast<size_t>(r.status)].inc_ref().ptr();
}

PyMethodDef fast_push_def = {
    "push", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_push)),
    METH_FASTCALL | METH_KEYWORDS,
    "push(id, prompt_tokens, max_new_tokens, priority=0, deadline_ns=0) -> PushStatus\n\n"
    "Never blocks. Raises ValueError for an invalid value."};

[[noreturn]] void reject_push(const py::args&, const py::kwargs&) {
  throw py::value_error(
      "push(id, prompt_tokens, max_new_tokens, priority=0, deadline_ns=0) takes integers: "
      "id, token counts and deadline in [0, 2^63), priority a valid level");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "streambatch batching core (C++17)";

  py::enum_<PushStatus>(m, "PushStatus")
      .value("ACCEPTED", PushStatus::kAccepted)
      .value("QUEUE_FULL", PushStatus::kQueueFull)
      .value("DUPLICATE_ID", PushStatus::kDuplicateId)
      .value("CLOSED", PushStatus::kClosed)
      .value("INVALID", PushStatus::kInvalid);
  for (auto s : {PushStatus::kAccepted, PushStatus::kQueueFull, PushStatus::kDuplicateId,
                 PushStatus::kClosed, PushStatus::kInvalid})
    status_objects().push_back(py::cast(s));

  py::enum_<ReleaseReason>(m, "ReleaseReason")
      .value("FULL", ReleaseReason::kFull)
      .value("WINDOW", ReleaseReason::kWindow)
      .value("MAX_WAIT", ReleaseReason::kMaxWait)
      .value("URGENT", ReleaseReason::kUrgent)
      .value("CLOSED", ReleaseReason::kClosed)
      .value("TIMEOUT", ReleaseReason::kTimeout)
      .value("EVICTED", ReleaseReason::kEvicted);

  py::class_<Clock, std::shared_ptr<Clock>>(m, "Clock").def("now_ns", &Clock::now_ns);
  py::class_<SteadyClock, Clock, std::shared_ptr<SteadyClock>>(m, "SteadyClock")
      .def(py::init<>());
  py::class_<ManualClock, Clock, std::shared_ptr<ManualClock>>(m, "ManualClock")
      .def(py::init<Nanos>(), py::arg("start_ns") = 0)
      .def("advance_ns", &ManualClock::advance_ns)
      .def("advance", [](ManualClock& c, double s) { c.advance_ns(seconds_to_ns(s)); })
      .def("set_ns", &ManualClock::set_ns);

  // The CLI checks the flag against it before the engine loads (the queue checks it after).
  m.attr("MAX_LIFO_BACKLOG_NS") = kMaxLifoBacklogNs;

  py::class_<QueueConfig>(m, "QueueConfig")
      .def(py::init<>())
      .def_readwrite("priority_levels", &QueueConfig::priority_levels)
      .def_readwrite("capacity", &QueueConfig::capacity)
      .def_readwrite("level_capacity", &QueueConfig::level_capacity)
      .def_readwrite("bucket_bounds", &QueueConfig::bucket_bounds)
      .def_readwrite("max_batch_requests", &QueueConfig::max_batch_requests)
      .def_readwrite("max_batch_tokens", &QueueConfig::max_batch_tokens)
      .def_readwrite("batch_window_ns", &QueueConfig::batch_window_ns)
      .def_readwrite("max_wait_ns", &QueueConfig::max_wait_ns)
      .def_readwrite("aging_interval_ns", &QueueConfig::aging_interval_ns)
      .def_readwrite("lifo_after_ns", &QueueConfig::lifo_after_ns)
      .def_readwrite("oldest_first_after_ns", &QueueConfig::oldest_first_after_ns)
      .def_readwrite("oldest_first_turns", &QueueConfig::oldest_first_turns)
      .def_readwrite("lifo_backlog_ns", &QueueConfig::lifo_backlog_ns)
      .def_readwrite("affinity_max_overtakes", &QueueConfig::affinity_max_overtakes)
      .def_readwrite("release_on_urgent", &QueueConfig::release_on_urgent);

  py::class_<PopResult>(m, "PopResult")
      .def_readonly("admitted", &PopResult::admitted)
      .def_readonly("expired", &PopResult::expired)
      .def_readonly("cancelled", &PopResult::cancelled)
      .def_readonly("reason", &PopResult::reason)
      .def("__repr__", [](const PopResult& r) {
        return "PopResult(admitted=" + std::to_string(r.admitted.size()) +
               ", expired=" + std::to_string(r.expired.size()) +
               ", cancelled=" + std::to_string(r.cancelled.size()) +
               ", reason=" + to_string(r.reason) + ")";
      });

  py::class_<QueueStats>(m, "QueueStats")
      .def_readonly("depth", &QueueStats::depth)
      .def_readonly("size", &QueueStats::size)
      .def_readonly("queued_tokens", &QueueStats::queued_tokens)
      .def_readonly("oldest_wait_ns", &QueueStats::oldest_wait_ns)
      .def_readonly("oldest_wait_ns_by_level", &QueueStats::oldest_wait_ns_by_level)
      .def_readonly("requeued", &QueueStats::requeued)
      .def_readonly("accepted", &QueueStats::accepted)
      .def_readonly("rejected_full", &QueueStats::rejected_full)
      .def_readonly("rejected_duplicate", &QueueStats::rejected_duplicate)
      .def_readonly("rejected_closed", &QueueStats::rejected_closed)
      .def_readonly("rejected_invalid", &QueueStats::rejected_invalid)
      .def_readonly("expired", &QueueStats::expired)
      .def_readonly("cancelled", &QueueStats::cancelled)
      .def_readonly("admitted", &QueueStats::admitted)
      .def_property_readonly("released", [](const QueueStats& s) {
        py::dict out;
        for (int i = 0; i < kReleaseReasonCount; ++i)
          out[to_string(static_cast<ReleaseReason>(i))] = s.released[static_cast<size_t>(i)];
        return out;
      });

  py::class_<BatchQueue> queue(m, "BatchQueue");
  queue
      .def(py::init([](const QueueConfig& c, std::shared_ptr<Clock> clock) {
             try {
               return new BatchQueue(c, std::move(clock));
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("config"), py::arg("clock") = nullptr)
      .def("_push", &push_or_raise, py::arg("id"), py::arg("prompt_tokens"),
           py::arg("max_new_tokens"), py::arg("priority") = 0, py::arg("deadline_ns") = 0)
      .def("_push", &reject_push)  // reached only when the arguments are not valid integers
      .def(
          "pop_batch",
          [](BatchQueue& q, std::int64_t max_requests, std::int64_t max_tokens, double timeout,
             const std::vector<RequestId>& preferred) {
            const Nanos timeout_ns = seconds_to_ns(timeout);
            py::gil_scoped_release release;
            return q.pop_batch(max_requests, max_tokens, timeout_ns, preferred);
          },
          py::arg("max_requests"), py::arg("max_tokens"), py::arg("timeout") = 0.0,
          py::arg("preferred") = std::vector<RequestId>{})
      .def(
          "requeue",
          [](BatchQueue& q, RequestId id, std::int64_t prompt_tokens, std::int64_t max_new_tokens,
             int priority, Nanos deadline_ns, Nanos enqueued_ns) {
            PushResult r =
                q.requeue(id, prompt_tokens, max_new_tokens, priority, deadline_ns, enqueued_ns);
            if (r.status == PushStatus::kInvalid) throw py::value_error(r.reason);
            return r.status;
          },
          py::arg("id"), py::arg("prompt_tokens"), py::arg("max_new_tokens"),
          py::arg("priority"), py::arg("deadline_ns"), py::arg("enqueued_ns"))
      .def("cancel", &BatchQueue::cancel, py::arg("id"))
      .def("close", &BatchQueue::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", &BatchQueue::stats)
      .def("size", &BatchQueue::size)
      .def("__len__", &BatchQueue::size)
      .def("now_ns", &BatchQueue::now_ns)
      .def("bucket_of", &BatchQueue::bucket_of)
      .def_property_readonly("config", [](const BatchQueue& q) { return q.config(); })
      .def_property_readonly("closed", &BatchQueue::closed);

  {
    auto* type = reinterpret_cast<PyTypeObject*>(queue.ptr());
    py::object descr = py::reinterpret_steal<py::object>(PyDescr_NewMethod(type, &fast_push_def));
    if (!descr) throw py::error_already_set();
    queue.attr("push") = descr;
  }

  m.def("push_status_name", [](PushStatus s) { return to_string(s); });
}
