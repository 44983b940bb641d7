// streambatch BatchQueue: decides which waiting requests enter the engine and when.
//
// Ownership: the queue owns every waiting request's bookkeeping (plain ids and numbers, never a
// Python object). Producers (the gRPC event loop) call push()/cancel(); one consumer (the engine
// worker) calls pop_batch(). All state sits behind one mutex; every public call holds it only for
// the bookkeeping itself, and pop_batch() waits on a condition variable with a computed timeout.
//
// Release rules: pop_batch() returns a batch as soon as one of these holds
//   kFull     enough live requests (or tokens) are queued to fill the caller's batch;
//   kUrgent   a request arrived at the top priority level (when release_on_urgent is set);
//   kMaxWait  the oldest waiting request has waited max_wait;
//   kWindow   the batch window, opened by the first arrival after the last release, has expired;
//   kClosed   the queue was closed: whatever is left is handed out without waiting.
// When none holds before the call's timeout it returns kTimeout with an empty batch; when only
// expiries or cancellations are to be reported it returns kEvicted at once, so the caller can
// finish those requests promptly.
//
// Order inside a batch (the same rule the Python reference in bench/ implements):
//   1. effective priority, highest first: priority + floor(wait / aging_interval), capped one
//      below the top level, so a waiting request is promoted one level per aging interval (no
//      starvation among the lower levels) but never competes with a request sent as urgent;
//   2. within a level, the head request's length bucket first, then the nearest buckets
//      (distance |b - head_bucket|, the shorter bucket first on a tie);
//   3. arrival order last: oldest first, except in a level whose oldest request has waited
//      lifo_after_ns or more (overload): there the newest first (adaptive LIFO, as in
//      Facebook's "Fail at Scale"), so under overload the requests that still have their
//      whole deadline are served while the old ones, likely past what their callers wait
//      for, give way; requests put back by requeue() still go first. With lifo_backlog_ns
//      set (at most kMaxLifoBacklogNs), a level is newest first only while its backlog (its
//      waiting requests and those of the levels above, requeued ones included) is more than
//      the queue admitted (re-admissions of requeued requests included) in the last
//      lifo_backlog_ns, scaled to that span in the queue's first lifo_backlog_ns: a backlog
//      that arrival order clears within that time (a burst while the engine keeps up) is
//      served oldest first, since newest first would make its oldest requests wait until the
//      whole backlog clears, longer than arrival order; and a level goes back to arrival order
//      once what is left is within reach. The rate counts wall time, idle time included:
//      after a lull it reads low and a burst counts as standing sooner. Each pop decides the
//      order once, for its whole batch. A request that has
//      waited oldest_first_after_ns (overdue) goes before the newer ones of its FIFO again,
//      oldest first: newer requests pass a caller with no deadline, or a long one, for that
//      long at most, or its turns (below) if longer (then it waits only for older overdue
//      requests, higher levels and, with length buckets, a nearer bucket's requests until it
//      is the head itself: one pop).
//      With oldest_first_turns set, a request is overdue only once, besides that time, that
//      many times as many requests as were waiting at its level and above when it arrived have
//      left the queue (admitted, expired or cancelled: its turn in arrival order), never before an
//      older request of its FIFO: a wait in time alone says nothing of how long arrival order
//      takes on this engine, and a bound below that makes every held request overdue and the
//      order arrival order again (on an engine 2.5x slower, many_docs' resident-prefix order
//      lost its whole gain to a 60 s bound).
// A pop may name preferred requests (the caller's choice: those whose prompt prefix the
// engine still holds in its prefix cache). A preferred request goes before every other one of
// its effective priority or lower, oldest first, except that the request the order above
// would take next is passed over this way at most affinity_max_overtakes times in all, then
// it goes first (a bounded delay, not starvation), and never once it is overdue (above); with
// the limit at 0 nothing is preferred.
// A FIFO's effective priority is its oldest request's, whichever end is taken from it. The
// head request is the first by (effective priority, arrival order). A request costs
// prompt_tokens + max_new_tokens (its KV footprint at the end) against the token budget; the
// batch stops at the first request that does not fit, so in arrival order a large request is
// never overtaken forever by smaller ones behind it (newest first, until the backlog clears or
// it is overdue; an overdue request that does not fit stops the batch like any head).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

namespace streambatch {

using RequestId = std::int64_t;
using Nanos = std::int64_t;

// Time source for every queue decision, injectable so tests are deterministic.
class Clock {
 public:
  virtual ~Clock() = default;
  [[nodiscard]] virtual Nanos now_ns() const = 0;
};

// std::chrono::steady_clock: CLOCK_MONOTONIC on Linux, the same base as Python's
// time.monotonic_ns(), so callers can compute absolute deadlines on their side.
class SteadyClock final : public Clock {
 public:
  [[nodiscard]] Nanos now_ns() const override;
};

// A clock that moves only when told to (tests).
class ManualClock final : public Clock {
 public:
  explicit ManualClock(Nanos start = 0) : now_(start) {}
  [[nodiscard]] Nanos now_ns() const override { return now_.load(); }
  void advance_ns(Nanos delta) { now_.fetch_add(delta); }
  void set_ns(Nanos t) { now_.store(t); }

 private:
  std::atomic<Nanos> now_;
};

inline constexpr Nanos kMaxLifoBacklogNs = 3'600'000'000'000;  // 1 h

struct QueueConfig {
  int priority_levels = 2;                  // levels 0..priority_levels-1; higher = more urgent
  std::int64_t capacity = 4096;             // live waiting requests, all levels together
  std::vector<std::int64_t> level_capacity; // optional per level; empty or 0 = no own limit
  std::vector<std::int64_t> bucket_bounds;  // ascending upper bounds (tokens) of prompt buckets
  std::int64_t max_batch_requests = 64;
  std::int64_t max_batch_tokens = 1 << 20;
  Nanos batch_window_ns = 0;                // 0: no window, release on arrival
  Nanos max_wait_ns = 50'000'000;           // the seed's 50 ms
  Nanos aging_interval_ns = 0;              // 0: no aging
  Nanos lifo_after_ns = 0;                  // 0: always arrival order (see "Order" above)
  Nanos oldest_first_after_ns = 0;          // a waiting request is overdue no sooner; 0: never overdue
  double oldest_first_turns = 0;            // ... nor before this many times its turn left; 0: time alone
  Nanos lifo_backlog_ns = 0;                // newest first only for a backlog of more admissions than this long's; 0: any
  std::int64_t affinity_max_overtakes = 0;  // preferred requests that may pass one; 0: off
  bool release_on_urgent = true;
};

enum class PushStatus { kAccepted, kQueueFull, kDuplicateId, kClosed, kInvalid };

struct PushResult {
  PushStatus status = PushStatus::kAccepted;
  std::string reason;  // why, for kQueueFull ("total"/"level") and kInvalid
};

enum class ReleaseReason { kFull, kWindow, kMaxWait, kUrgent, kClosed, kTimeout, kEvicted };
inline constexpr int kReleaseReasonCount = 7;

struct PopResult {
  std::vector<RequestId> admitted;   // in batch order
  std::vector<RequestId> expired;    // deadline passed while queued: never send to the engine
  std::vector<RequestId> cancelled;  // cancelled while queued
  ReleaseReason reason = ReleaseReason::kTimeout;
};

struct QueueStats {
  std::vector<std::vector<std::int64_t>> depth;  // [level][bucket], live waiting requests
  std::int64_t size = 0;
  std::int64_t queued_tokens = 0;
  Nanos oldest_wait_ns = 0;
  std::vector<Nanos> oldest_wait_ns_by_level;  // 0 where the level is empty
  std::int64_t accepted = 0;
  std::int64_t rejected_full = 0;
  std::int64_t rejected_duplicate = 0;
  std::int64_t rejected_closed = 0;
  std::int64_t rejected_invalid = 0;
  std::int64_t expired = 0;
  std::int64_t cancelled = 0;
  std::int64_t admitted = 0;
  std::int64_t requeued = 0;
  std::vector<std::int64_t> released;  // indexed by ReleaseReason
};

class BatchQueue {
 public:
  // Throws std::invalid_argument for an unusable configuration.
  explicit BatchQueue(QueueConfig config, std::shared_ptr<const Clock> clock = nullptr);

  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  // Never blocks. deadline_ns is absolute on this queue's clock; 0 means none.
  [[nodiscard]] PushResult push(RequestId id, std::int64_t prompt_tokens,
                                std::int64_t max_new_tokens, int priority, Nanos deadline_ns);

  // Puts back a request the caller took out earlier (priority preemption: the engine stopped it
  // to make room). Not a new arrival, so the capacity limits do not apply; it goes to the front
  // of its FIFO so it is the next of its level and bucket, and its wait counts from
  // enqueued_ns (its first arrival) for aging and max-wait. Returns kDuplicateId, kClosed or
  // kInvalid like push().
  [[nodiscard]] PushResult requeue(RequestId id, std::int64_t prompt_tokens,
                                   std::int64_t max_new_tokens, int priority, Nanos deadline_ns,
                                   Nanos enqueued_ns);

  // Blocks up to timeout_ns (on this queue's clock) until a release rule fires.
  // max_requests / max_tokens are the caller's room, capped by the configured batch limits.
  // preferred: waiting requests to take first (see "Order" above); unknown ids are ignored.
  [[nodiscard]] PopResult pop_batch(std::int64_t max_requests, std::int64_t max_tokens,
                                    Nanos timeout_ns,
                                    const std::vector<RequestId>& preferred = {});

  // True when id was waiting; it is reported in the next pop's `cancelled`.
  bool cancel(RequestId id);
  // Wakes every waiter; later pushes return kClosed; the rest is handed out without waiting.
  void close();

  [[nodiscard]] QueueStats stats() const;
  [[nodiscard]] std::int64_t size() const;
  [[nodiscard]] bool closed() const;
  [[nodiscard]] Nanos now_ns() const { return clock_->now_ns(); }
  [[nodiscard]] const QueueConfig& config() const { return config_; }
  [[nodiscard]] int bucket_of(std::int64_t prompt_tokens) const;

 private:
  struct Entry {
    std::int64_t prompt_tokens;
    std::int64_t max_new_tokens;
    int priority;
    int bucket;
    Nanos enqueued_ns;
    Nanos deadline_ns;
    std::uint64_t seq;
    std::int64_t due_departures = 0;  // overdue no sooner than departures_locked() reaches this
    std::int64_t overtaken = 0;  // preferred requests taken before it while it was next
    [[nodiscard]] std::int64_t cost() const { return prompt_tokens + max_new_tokens; }
  };
  // One FIFO per (priority, bucket). A slot copies what ordering needs so batch selection
  // never touches the hash map; seq tells a live slot from a tombstone left by cancel/expiry.
  struct Slot {
    RequestId id;
    std::uint64_t seq;
    Nanos enqueued_ns;
    std::int64_t cost;
    std::int64_t due_departures;
  };
  // Ordering key of one FIFO's head during a selection (scratch, reused across pops).
  struct HeadKey {
    bool live = false;
    int eff = 0;
    int dist = 0;
    int bucket = 0;
    std::uint64_t seq = 0;  // order_key of the slot selection would take
    bool back = false;      // that slot is the FIFO's back (LIFO level)
  };
  // A preferred request during a selection (scratch, reused across pops).
  struct Preferred {
    RequestId id;
    std::uint64_t seq;
    int eff;
  };
  struct DeadlineItem {
    Nanos deadline_ns;
    RequestId id;
    std::uint64_t seq;
    bool operator>(const DeadlineItem& o) const { return deadline_ns > o.deadline_ns; }
  };

  void insert_locked(RequestId id, const Entry& e, bool front);
  [[nodiscard]] std::string validate(std::int64_t prompt_tokens, std::int64_t max_new_tokens,
                                     int priority, Nanos deadline_ns) const;
  [[nodiscard]] std::deque<Slot>& fifo(int priority, int bucket) {
    return fifos_[static_cast<size_t>(priority) * bucket_count_ + static_cast<size_t>(bucket)];
  }
  [[nodiscard]] int effective_priority(int priority, Nanos enqueued_ns, Nanos now) const;
  void remove_locked(RequestId id, const Entry& e);  // cancel/expiry: leaves a tombstone
  void drop_dead_heads_locked(size_t fifo_index);
  void drop_dead_tails_locked(size_t fifo_index);
  // The slot selection would take next from a FIFO (front, or back in a LIFO level), and its
  // arrival-order key (smaller first).
  [[nodiscard]] bool takes_back_locked(size_t fifo_index, Nanos now) const;
  // Waited oldest_first_after_ns and its turns: no newer request (newest first, preferred)
  // goes before it.
  [[nodiscard]] bool overdue_locked(Nanos enqueued_ns, std::int64_t due_departures,
                                    Nanos now) const {
    return config_.oldest_first_after_ns > 0 &&
           now - enqueued_ns >= config_.oldest_first_after_ns &&
           departures_locked() >= due_departures;
  }
  // Requests that left the queue (admitted, expired, cancelled): what oldest_first_turns counts.
  [[nodiscard]] std::int64_t departures_locked() const {
    return counters_.admitted + counters_.expired + counters_.cancelled;
  }
  // The departures after which a request arriving now in FIFO `fifo_index` may be overdue.
  [[nodiscard]] std::int64_t due_departures_locked(size_t fifo_index);
  // True when level p's backlog (live requests at p and above) is more than the queue admits
  // in lifo_backlog_ns at the rate of the last lifo_backlog_ns (or of the time since it was
  // created, if shorter), and always when lifo_backlog_ns is 0.
  [[nodiscard]] bool backlog_standing_locked(int p, Nanos now);
  void note_admissions_locked(size_t count, Nanos now);
  void forget_admissions_before_locked(Nanos now);  // those at or before now - lifo_backlog_ns
  [[nodiscard]] static std::uint64_t order_key(std::uint64_t seq, bool newest_first);
  void expire_locked(Nanos now, std::vector<RequestId>& out);
  [[nodiscard]] bool release_reason_locked(Nanos now, std::int64_t max_requests,
                                           std::int64_t max_tokens, ReleaseReason& why);
  [[nodiscard]] Nanos next_event_locked(Nanos now) const;
  [[nodiscard]] Nanos oldest_enqueued_locked() const;
  void select_locked(Nanos now, std::int64_t max_requests, std::int64_t max_tokens,
                     const std::vector<RequestId>& preferred, std::vector<RequestId>& out);
  void collect_preferred_locked(Nanos now, const std::vector<RequestId>& preferred);

  const QueueConfig config_;
  const std::shared_ptr<const Clock> clock_;
  const size_t bucket_count_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<RequestId, Entry> entries_;
  std::vector<std::deque<Slot>> fifos_;
  std::priority_queue<DeadlineItem, std::vector<DeadlineItem>, std::greater<>> deadlines_;
  std::vector<std::int64_t> level_size_;
  std::vector<std::int64_t> depth_;       // live slots per FIFO [priority * bucket_count_ + bucket]
  std::vector<std::int64_t> tombstones_;  // dead slots per FIFO; 0 lets selection skip lookups
  std::vector<RequestId> cancelled_;
  std::vector<HeadKey> head_keys_;
  std::vector<char> lifo_level_;  // scratch of select_locked: level served newest first
  std::vector<Preferred> preferred_;  // scratch of select_locked, best first
  std::int64_t queued_tokens_ = 0;
  const Nanos created_ns_;
  // The pops of the last lifo_backlog_ns that admitted requests (when the rule can act).
  struct RecentPop {
    Nanos at_ns;
    std::int64_t admitted;
  };
  std::deque<RecentPop> recent_pops_;
  std::int64_t recent_admitted_ = 0;  // their sum
  // Arrivals take increasing sequence numbers from the middle of the range, requeued requests
  // decreasing ones below it, so a requeued request sorts before every arrival.
  static constexpr std::uint64_t kFirstSeq = std::uint64_t{1} << 62;
  std::uint64_t next_seq_ = kFirstSeq;
  std::uint64_t next_front_seq_ = kFirstSeq - 1;
  Nanos window_start_ns_ = -1;  // -1: no window open
  bool urgent_pending_ = false;
  bool closed_ = false;
  QueueStats counters_;
};

[[nodiscard]] const char* to_string(PushStatus s);
[[nodiscard]] const char* to_string(ReleaseReason r);

}  // namespace streambatch
