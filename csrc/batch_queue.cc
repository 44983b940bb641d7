#include "batch_queue.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <utility>

namespace streambatch {
namespace {

constexpr std::int64_t kMaxTokenValue = std::int64_t{1} << 40;  // keeps sums far from overflow
constexpr Nanos kNever = std::numeric_limits<Nanos>::max();

}  // namespace

Nanos SteadyClock::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const char* to_string(PushStatus s) {
  switch (s) {
    case PushStatus::kAccepted: return "accepted";
    case PushStatus::kQueueFull: return "queue_full";
    case PushStatus::kDuplicateId: return "duplicate_id";
    case PushStatus::kClosed: return "closed";
    case PushStatus::kInvalid: return "invalid";
  }
  return "unknown";
}

const char* to_string(ReleaseReason r) {
  switch (r) {
    case ReleaseReason::kFull: return "full";
    case ReleaseReason::kWindow: return "window";
    case ReleaseReason::kMaxWait: return "max_wait";
    case ReleaseReason::kUrgent: return "urgent";
    case ReleaseReason::kClosed: return "closed";
    case ReleaseReason::kTimeout: return "timeout";
    case ReleaseReason::kEvicted: return "evicted";
  }
  return "unknown";
}

static QueueConfig checked(QueueConfig c) {
  if (c.priority_levels < 1 || c.priority_levels > 64)
    throw std::invalid_argument("priority_levels must be in [1, 64]");
  if (c.capacity < 1) throw std::invalid_argument("capacity must be >= 1");
  if (!c.level_capacity.empty() &&
      c.level_capacity.size() != static_cast<size_t>(c.priority_levels))
    throw std::invalid_argument("level_capacity needs one entry per priority level");
  for (auto cap : c.level_capacity)
    if (cap < 0) throw std::invalid_argument("level_capacity entries must be >= 0 (0 = no limit)");
  for (size_t i = 0; i < c.bucket_bounds.size(); ++i) {
    if (c.bucket_bounds[i] < 1)
      throw std::invalid_argument("bucket_bounds must be positive token counts");
    if (i > 0 && c.bucket_bounds[i] <= c.bucket_bounds[i - 1])
      throw std::invalid_argument("bucket_bounds must be strictly ascending");
  }
  if (c.bucket_bounds.size() > 256) throw std::invalid_argument("at most 256 bucket bounds");
  if (c.max_batch_requests < 1) throw std::invalid_argument("max_batch_requests must be >= 1");
  if (c.max_batch_tokens < 1) throw std::invalid_argument("max_batch_tokens must be >= 1");
  if (c.batch_window_ns < 0 || c.max_wait_ns < 0 || c.aging_interval_ns < 0 ||
      c.lifo_after_ns < 0 || c.oldest_first_after_ns < 0 || c.lifo_backlog_ns < 0)
    throw std::invalid_argument(
        "batch_window, max_wait, aging_interval, lifo_after, oldest_first_after and "
        "lifo_backlog must be >= 0");
  if (c.lifo_backlog_ns > kMaxLifoBacklogNs)
    throw std::invalid_argument(
        "lifo_backlog must be at most 3600 s (the queue keeps each pop of that long)");
  if (c.oldest_first_after_ns > 0 && c.oldest_first_after_ns <= c.lifo_after_ns)
    throw std::invalid_argument(
        "oldest_first_after must be above lifo_after, or 0 (at or below it, the bound would "
        "end newest-first order as soon as it begins)");
  if (!(c.oldest_first_turns >= 0 && c.oldest_first_turns < 1e6))
    throw std::invalid_argument("oldest_first_turns must be in [0, 1e6) (0 = the time alone)");
  if (c.affinity_max_overtakes < 0)
    throw std::invalid_argument("affinity_max_overtakes must be >= 0 (0 = no preference)");
  return c;
}

BatchQueue::BatchQueue(QueueConfig config, std::shared_ptr<const Clock> clock)
    : config_(checked(std::move(config))),
      clock_(clock ? std::move(clock) : std::make_shared<SteadyClock>()),
      bucket_count_(config_.bucket_bounds.size() + 1),
      fifos_(static_cast<size_t>(config_.priority_levels) * bucket_count_),
      level_size_(static_cast<size_t>(config_.priority_levels), 0),
      depth_(fifos_.size(), 0),
      tombstones_(fifos_.size(), 0),
      created_ns_(clock_->now_ns()) {
  counters_.released.assign(kReleaseReasonCount, 0);
  entries_.reserve(static_cast<size_t>(std::min<std::int64_t>(config_.capacity, 1 << 16)));
}

int BatchQueue::bucket_of(std::int64_t prompt_tokens) const {
  const auto& b = config_.bucket_bounds;
  return static_cast<int>(std::lower_bound(b.begin(), b.end(), prompt_tokens) - b.begin());
}

std::string BatchQueue::validate(std::int64_t prompt_tokens, std::int64_t max_new_tokens,
                                 int priority, Nanos deadline_ns) const {
  if (prompt_tokens < 0 || prompt_tokens > kMaxTokenValue)
    return "prompt_tokens must be in [0, 2^40]";
  if (max_new_tokens < 0 || max_new_tokens > kMaxTokenValue)
    return "max_new_tokens must be in [0, 2^40]";
  if (priority < 0 || priority >= config_.priority_levels)
    return "priority must be in [0, " + std::to_string(config_.priority_levels - 1) + "]";
  if (deadline_ns < 0) return "deadline must be >= 0 (0 = none)";
  if (prompt_tokens + max_new_tokens > config_.max_batch_tokens)
    return "request needs " + std::to_string(prompt_tokens + max_new_tokens) +
           " tokens, more than max_batch_tokens " + std::to_string(config_.max_batch_tokens);
  return {};
}

PushResult BatchQueue::push(RequestId id, std::int64_t prompt_tokens, std::int64_t max_new_tokens,
                            int priority, Nanos deadline_ns) {
  std::string problem = id < 0 ? std::string("id must be >= 0")
                               : validate(prompt_tokens, max_new_tokens, priority, deadline_ns);
  const Nanos now = clock_->now_ns();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!problem.empty()) {
      ++counters_.rejected_invalid;
      return {PushStatus::kInvalid, std::move(problem)};
    }
    if (closed_) {
      ++counters_.rejected_closed;
      return {PushStatus::kClosed, "queue is closed"};
    }
    if (entries_.count(id) != 0) {
      ++counters_.rejected_duplicate;
      return {PushStatus::kDuplicateId, "id is already queued"};
    }
    if (static_cast<std::int64_t>(entries_.size()) >= config_.capacity) {
      ++counters_.rejected_full;
      return {PushStatus::kQueueFull, "total"};
    }
    const auto level = static_cast<size_t>(priority);
    if (!config_.level_capacity.empty() && config_.level_capacity[level] > 0 &&
        level_size_[level] >= config_.level_capacity[level]) {
      ++counters_.rejected_full;
      return {PushStatus::kQueueFull, "level"};
    }
    const int bucket = bucket_of(prompt_tokens);
    const size_t index = static_cast<size_t>(priority) * bucket_count_ + static_cast<size_t>(bucket);
    insert_locked(id,
                  Entry{prompt_tokens, max_new_tokens, priority, bucket, now, deadline_ns,
                        next_seq_++, due_departures_locked(index)},
                  /*front=*/false);
    ++counters_.accepted;
  }
  cv_.notify_one();
  return {};
}

PushResult BatchQueue::requeue(RequestId id, std::int64_t prompt_tokens,
                               std::int64_t max_new_tokens, int priority, Nanos deadline_ns,
                               Nanos enqueued_ns) {
  std::string problem = id < 0 ? std::string("id must be >= 0")
                               : validate(prompt_tokens, max_new_tokens, priority, deadline_ns);
  const Nanos now = clock_->now_ns();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!problem.empty()) return {PushStatus::kInvalid, std::move(problem)};
    if (closed_) return {PushStatus::kClosed, "queue is closed"};
    if (entries_.count(id) != 0) return {PushStatus::kDuplicateId, "id is already queued"};
    const int bucket = bucket_of(prompt_tokens);
    // The FIFO stays ordered by arrival: never claim to have arrived after its current head.
    const auto& q = fifo(priority, bucket);
    Nanos since = std::min(enqueued_ns, now);
    if (!q.empty()) since = std::min(since, q.front().enqueued_ns);
    insert_locked(id,
                  Entry{prompt_tokens, max_new_tokens, priority, bucket, since, deadline_ns,
                        next_front_seq_--},
                  /*front=*/true);
    ++counters_.requeued;
  }
  cv_.notify_one();
  return {};
}

std::int64_t BatchQueue::due_departures_locked(size_t fifo_index) {
  if (config_.oldest_first_turns <= 0) return 0;
  std::int64_t ahead = 0;  // its turn: everyone waiting at its level and above leaves first
  for (size_t p = fifo_index / bucket_count_; p < level_size_.size(); ++p) ahead += level_size_[p];
  const double turns = std::ceil(config_.oldest_first_turns * static_cast<double>(ahead));
  const std::int64_t due = departures_locked() + static_cast<std::int64_t>(turns);
  // Never before the newest request still waiting in its FIFO (its own due is the largest
  // there): the FIFO's requests turn overdue in their order. A requeued one at the back has 0.
  drop_dead_tails_locked(fifo_index);
  const auto& q = fifos_[fifo_index];
  return q.empty() ? due : std::max(due, q.back().due_departures);
}

void BatchQueue::insert_locked(RequestId id, const Entry& e, bool front) {
  entries_.emplace(id, e);
  const Slot slot{id, e.seq, e.enqueued_ns, e.cost(), e.due_departures};
  auto& q = fifo(e.priority, e.bucket);
  if (front) {
    q.push_front(slot);
  } else {
    q.push_back(slot);
  }
  if (e.deadline_ns > 0) deadlines_.push(DeadlineItem{e.deadline_ns, id, e.seq});
  const auto level = static_cast<size_t>(e.priority);
  ++level_size_[level];
  ++depth_[level * bucket_count_ + static_cast<size_t>(e.bucket)];
  queued_tokens_ += e.cost();
  if (window_start_ns_ < 0) window_start_ns_ = e.enqueued_ns;
  if (e.priority == config_.priority_levels - 1) urgent_pending_ = true;
}

void BatchQueue::remove_locked(RequestId id, const Entry& e) {
  const auto level = static_cast<size_t>(e.priority);
  const size_t index = level * bucket_count_ + static_cast<size_t>(e.bucket);
  --level_size_[level];
  --depth_[index];
  queued_tokens_ -= e.cost();
  entries_.erase(id);
  ++tombstones_[index];
  drop_dead_heads_locked(index);
  // Tombstones in the middle of a FIFO wait to reach its head; compact when they dominate.
  auto& q = fifos_[index];
  if (q.size() > 64 && q.size() > 2 * static_cast<size_t>(depth_[index])) {
    std::deque<Slot> live;
    for (const auto& s : q) {
      auto it = entries_.find(s.id);
      if (it != entries_.end() && it->second.seq == s.seq) live.push_back(s);
    }
    q.swap(live);
    tombstones_[index] = 0;
  }
}

void BatchQueue::drop_dead_heads_locked(size_t index) {
  auto& q = fifos_[index];
  while (tombstones_[index] > 0 && !q.empty()) {
    auto it = entries_.find(q.front().id);
    if (it != entries_.end() && it->second.seq == q.front().seq) return;
    q.pop_front();
    --tombstones_[index];
  }
}

void BatchQueue::drop_dead_tails_locked(size_t index) {
  auto& q = fifos_[index];
  while (tombstones_[index] > 0 && !q.empty()) {
    auto it = entries_.find(q.back().id);
    if (it != entries_.end() && it->second.seq == q.back().seq) return;
    q.pop_back();
    --tombstones_[index];
  }
}

bool BatchQueue::takes_back_locked(size_t index, Nanos now) const {
  const auto& q = fifos_[index];
  // A requeued request (seq below kFirstSeq) sits at the front and goes first either way, and
  // so does an overdue one (the front is live: dead heads are dropped as they appear).
  return lifo_level_[index / bucket_count_] != 0 && q.front().seq >= kFirstSeq &&
         !overdue_locked(q.front().enqueued_ns, q.front().due_departures, now);
}

void BatchQueue::forget_admissions_before_locked(Nanos now) {
  while (!recent_pops_.empty() && recent_pops_.front().at_ns <= now - config_.lifo_backlog_ns) {
    recent_admitted_ -= recent_pops_.front().admitted;
    recent_pops_.pop_front();
  }
}

void BatchQueue::note_admissions_locked(size_t count, Nanos now) {
  if (config_.lifo_backlog_ns <= 0 || config_.lifo_after_ns <= 0) return;  // nothing reads them
  recent_pops_.push_back(RecentPop{now, static_cast<std::int64_t>(count)});
  recent_admitted_ += static_cast<std::int64_t>(count);
  forget_admissions_before_locked(now);
}

bool BatchQueue::backlog_standing_locked(int p, Nanos now) {
  const Nanos horizon = config_.lifo_backlog_ns;
  if (horizon <= 0) return true;
  forget_admissions_before_locked(now);
  std::int64_t backlog = 0;
  for (int q = p; q < config_.priority_levels; ++q) backlog += level_size_[static_cast<size_t>(q)];
  // backlog / rate > horizon, with rate = admissions / window; in doubles (as the Python
  // reference computes it) since window * backlog can pass 2^63 ns.
  const Nanos window = std::min(horizon, now - created_ns_);
  return static_cast<double>(backlog) * static_cast<double>(window) >
         static_cast<double>(recent_admitted_) * static_cast<double>(horizon);
}

std::uint64_t BatchQueue::order_key(std::uint64_t seq, bool newest_first) {
  // Requeued requests keep their (small) seq; arrivals in a LIFO level map to a key that
  // falls as seq grows, above every requeued seq: kFirstSeq + (max - seq) cannot overflow.
  if (!newest_first || seq < kFirstSeq) return seq;
  return kFirstSeq + (std::numeric_limits<std::uint64_t>::max() - seq);
}

void BatchQueue::expire_locked(Nanos now, std::vector<RequestId>& out) {
  while (!deadlines_.empty() && deadlines_.top().deadline_ns <= now) {
    const DeadlineItem item = deadlines_.top();
    deadlines_.pop();
    auto it = entries_.find(item.id);
    if (it == entries_.end() || it->second.seq != item.seq) continue;  // already gone
    const Entry e = it->second;
    remove_locked(item.id, e);
    out.push_back(item.id);
    ++counters_.expired;
  }
  // Deadlines of requests admitted earlier stay in the heap; rebuild when they dominate.
  if (deadlines_.size() > 64 && deadlines_.size() > 2 * entries_.size()) {
    decltype(deadlines_) live;
    for (const auto& [id, e] : entries_)
      if (e.deadline_ns > 0) live.push(DeadlineItem{e.deadline_ns, id, e.seq});
    deadlines_.swap(live);
  }
}

int BatchQueue::effective_priority(int priority, Nanos enqueued_ns, Nanos now) const {
  // The top level is never reached by aging: it is what priority preemption and reserved slots
  // serve, and an aged request there would take (by its older arrival) the slot a preemption
  // freed for an urgent one. Measured: with two levels and 2 s aging, under 2x overload every
  // low request waiting 2 s outranked new high ones; 43 % of high calls finished in time.
  const Nanos top = config_.priority_levels - 1;
  if (config_.aging_interval_ns <= 0 || priority >= top) return priority;
  const Nanos promoted = (now - enqueued_ns) / config_.aging_interval_ns;
  return static_cast<int>(std::min<Nanos>(top - 1, priority + std::max<Nanos>(0, promoted)));
}

Nanos BatchQueue::oldest_enqueued_locked() const {
  Nanos oldest = kNever;
  for (const auto& q : fifos_)
    if (!q.empty()) oldest = std::min(oldest, q.front().enqueued_ns);
  return oldest;
}

bool BatchQueue::release_reason_locked(Nanos now, std::int64_t max_requests,
                                       std::int64_t max_tokens, ReleaseReason& why) {
  if (entries_.empty()) return false;
  if (closed_) {
    why = ReleaseReason::kClosed;
  } else if (static_cast<std::int64_t>(entries_.size()) >= max_requests ||
             queued_tokens_ >= max_tokens) {
    why = ReleaseReason::kFull;
  } else if (urgent_pending_ && config_.release_on_urgent) {
    why = ReleaseReason::kUrgent;
  } else if (config_.max_wait_ns > 0 && now - oldest_enqueued_locked() >= config_.max_wait_ns) {
    why = ReleaseReason::kMaxWait;
  } else if (window_start_ns_ >= 0 && now - window_start_ns_ >= config_.batch_window_ns) {
    why = ReleaseReason::kWindow;
  } else {
    return false;
  }
  return true;
}

Nanos BatchQueue::next_event_locked(Nanos now) const {
  Nanos next = kNever;
  if (!entries_.empty()) {
    if (config_.max_wait_ns > 0) next = std::min(next, oldest_enqueued_locked() + config_.max_wait_ns);
    if (window_start_ns_ >= 0) next = std::min(next, window_start_ns_ + config_.batch_window_ns);
  }
  if (!deadlines_.empty()) next = std::min(next, deadlines_.top().deadline_ns);
  return std::max(next, now);
}

void BatchQueue::collect_preferred_locked(Nanos now, const std::vector<RequestId>& preferred) {
  preferred_.clear();
  if (config_.affinity_max_overtakes <= 0) return;
  for (const RequestId id : preferred) {
    const auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry& e = it->second;
    preferred_.push_back(Preferred{id, e.seq, effective_priority(e.priority, e.enqueued_ns, now)});
  }
  std::sort(preferred_.begin(), preferred_.end(), [](const Preferred& a, const Preferred& b) {
    return a.eff != b.eff ? a.eff > b.eff : a.seq < b.seq;
  });
  // A caller naming an id twice gets it once.
  preferred_.erase(std::unique(preferred_.begin(), preferred_.end(),
                               [](const Preferred& a, const Preferred& b) { return a.id == b.id; }),
                   preferred_.end());
}

void BatchQueue::select_locked(Nanos now, std::int64_t max_requests, std::int64_t max_tokens,
                               const std::vector<RequestId>& preferred,
                               std::vector<RequestId>& out) {
  const int levels = config_.priority_levels;
  const int buckets = static_cast<int>(bucket_count_);
  // Levels in overload (their oldest arrival waited lifo_after_ns) are served newest first.
  // Requeued requests (at the front, seq below kFirstSeq) do not count: their wait includes
  // the time they ran before a preemption stopped them, which says nothing about a backlog.
  lifo_level_.assign(static_cast<size_t>(levels), 0);
  if (config_.lifo_after_ns > 0) {
    for (int p = 0; p < levels; ++p) {
      for (int b = 0; b < buckets; ++b) {
        const size_t index = static_cast<size_t>(p) * bucket_count_ + static_cast<size_t>(b);
        for (const Slot& s : fifos_[index]) {
          if (s.seq < kFirstSeq) continue;
          if (tombstones_[index] > 0) {  // a cancelled or expired arrival says nothing either
            const auto it = entries_.find(s.id);
            if (it == entries_.end() || it->second.seq != s.seq) continue;
          }
          if (now - s.enqueued_ns >= config_.lifo_after_ns) lifo_level_[static_cast<size_t>(p)] = 1;
          break;
        }
      }
      if (lifo_level_[static_cast<size_t>(p)] != 0 && !backlog_standing_locked(p, now))
        lifo_level_[static_cast<size_t>(p)] = 0;
    }
  }
  // Each FIFO's key: (effective priority desc, bucket distance, bucket, arrival order) of the
  // slot it would give next. `now` is fixed for the whole selection, so a FIFO's key changes
  // only when a slot is taken from it: keys are computed once and refreshed for that one FIFO
  // per pick. The distance is from the head request's bucket, known once every key is.
  int head_bucket = -1;
  auto& keys = head_keys_;
  keys.resize(fifos_.size());
  auto refresh = [&](size_t index) {
    const auto& q = fifos_[index];
    HeadKey& k = keys[index];
    k.live = !q.empty();
    if (!k.live) return;
    const int p = static_cast<int>(index / bucket_count_);
    k.back = takes_back_locked(index, now);
    if (k.back) drop_dead_tails_locked(index);
    // Aging lifts a FIFO by its oldest request, whichever end is taken from it: a level
    // served newest first still climbs as its backlog ages (no starvation below).
    k.eff = effective_priority(p, q.front().enqueued_ns, now);
    k.bucket = static_cast<int>(index % bucket_count_);
    k.dist = std::abs(k.bucket - head_bucket);
    k.seq = order_key((k.back ? q.back() : q.front()).seq, k.back);
  };
  // The head request: best by (effective priority, arrival order).
  const HeadKey* head = nullptr;
  for (size_t i = 0; i < fifos_.size(); ++i) {
    refresh(i);
    const HeadKey& k = keys[i];
    if (k.live && (head == nullptr || k.eff > head->eff ||
                   (k.eff == head->eff && k.seq < head->seq)))
      head = &k;
  }
  if (head == nullptr) return;
  head_bucket = head->bucket;
  for (auto& k : keys) k.dist = std::abs(k.bucket - head_bucket);
  collect_preferred_locked(now, preferred);
  size_t next_preferred = 0;

  std::int64_t tokens = 0;
  while (static_cast<std::int64_t>(out.size()) < max_requests) {
    const HeadKey* pick = nullptr;
    size_t pick_index = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const HeadKey& k = keys[i];
      if (!k.live) continue;
      const bool better =
          pick == nullptr || k.eff > pick->eff ||
          (k.eff == pick->eff &&
           (k.dist < pick->dist ||
            (k.dist == pick->dist &&
             (k.bucket < pick->bucket || (k.bucket == pick->bucket && k.seq < pick->seq)))));
      if (better) {
        pick = &k;
        pick_index = i;
      }
    }
    // The best preferred request still waiting goes first, unless the order above outranks it,
    // the request it would pass over has been passed over affinity_max_overtakes times or was
    // requeued, or it does not fit (then no preferred request goes first in this batch).
    while (next_preferred < preferred_.size()) {
      const auto it = entries_.find(preferred_[next_preferred].id);
      if (it != entries_.end() && it->second.seq == preferred_[next_preferred].seq) break;
      ++next_preferred;  // already taken by the order above
    }
    if (next_preferred < preferred_.size()) {
      const Preferred& pref = preferred_[next_preferred];
      Entry* passed = nullptr;  // the request the order above takes next, if any
      if (pick != nullptr) {
        const auto& pq = fifos_[pick_index];
        passed = &entries_.at((pick->back ? pq.back() : pq.front()).id);
      }
      // A request put back after a preemption is never passed over (it resumes first), nor
      // an overdue one.
      const bool may_pass = passed == nullptr ||
                            (pref.eff >= pick->eff && passed->seq >= kFirstSeq &&
                             passed->overtaken < config_.affinity_max_overtakes &&
                             !overdue_locked(passed->enqueued_ns, passed->due_departures, now));
      const Entry e = entries_.at(pref.id);
      if (may_pass && tokens + e.cost() > max_tokens) {
        // A preferred request that does not fit passes nobody: the order above goes on (its
        // own head is what the no-overtaking rule protects).
        next_preferred = preferred_.size();
      } else if (may_pass) {
        tokens += e.cost();
        if (passed != nullptr) ++passed->overtaken;
        out.push_back(pref.id);
        const size_t index =
            static_cast<size_t>(e.priority) * bucket_count_ + static_cast<size_t>(e.bucket);
        remove_locked(pref.id, e);  // a tombstone where it stood in its FIFO
        drop_dead_tails_locked(index);
        refresh(index);
        ++next_preferred;
        continue;
      }
    }
    if (pick == nullptr) break;
    auto& q = fifos_[pick_index];
    const bool back = pick->back;
    const Slot slot = back ? q.back() : q.front();
    if (tokens + slot.cost > max_tokens) break;  // no overtaking past a request that does not fit
    tokens += slot.cost;
    out.push_back(slot.id);
    // The taken end is live by invariant: remove it without a tombstone (one hash operation).
    const auto level = pick_index / bucket_count_;
    if (back) {
      q.pop_back();
    } else {
      q.pop_front();
    }
    entries_.erase(slot.id);
    --level_size_[level];
    --depth_[pick_index];
    queued_tokens_ -= slot.cost;
    drop_dead_heads_locked(pick_index);
    drop_dead_tails_locked(pick_index);
    refresh(pick_index);
  }
}

PopResult BatchQueue::pop_batch(std::int64_t max_requests, std::int64_t max_tokens,
                                Nanos timeout_ns, const std::vector<RequestId>& preferred) {
  PopResult result;
  max_requests = std::min(std::max<std::int64_t>(max_requests, 0), config_.max_batch_requests);
  max_tokens = std::min(std::max<std::int64_t>(max_tokens, 0), config_.max_batch_tokens);
  const Nanos start = clock_->now_ns();
  const Nanos call_deadline =
      timeout_ns <= 0 ? start : (timeout_ns > kNever - start ? kNever : start + timeout_ns);

  std::unique_lock<std::mutex> lock(mu_);
  // Set when a rule fired but the head did not fit the caller's budget: until a push, only
  // the passage of time (aging, a level turning newest-first) can change the head, and then
  // only to what the worker's next poll sees anyway (it polls with timeout 0 while anything
  // runs, and with nothing running the engine's whole budget is free).
  bool budget_blocked = false;
  std::uint64_t seq_at_block = 0;
  for (;;) {
    const Nanos now = clock_->now_ns();
    expire_locked(now, result.expired);
    if (!cancelled_.empty()) {
      result.cancelled.insert(result.cancelled.end(), cancelled_.begin(), cancelled_.end());
      cancelled_.clear();
    }
    ReleaseReason why{};
    if (max_requests > 0 && release_reason_locked(now, max_requests, max_tokens, why)) {
      select_locked(now, max_requests, max_tokens, preferred, result.admitted);
      if (!result.admitted.empty()) {
        result.reason = why;
        urgent_pending_ = false;
        window_start_ns_ = entries_.empty() ? -1 : now;
        counters_.admitted += static_cast<std::int64_t>(result.admitted.size());
        note_admissions_locked(result.admitted.size(), now);
        break;
      }
      budget_blocked = true;
      seq_at_block = next_seq_;
    }
    if (!result.expired.empty() || !result.cancelled.empty()) {
      result.reason = ReleaseReason::kEvicted;
      break;
    }
    if (closed_) {
      result.reason = ReleaseReason::kClosed;
      break;
    }
    if (now >= call_deadline) {
      result.reason = ReleaseReason::kTimeout;
      break;
    }
    Nanos wake = call_deadline;
    if (!budget_blocked || next_seq_ != seq_at_block) wake = std::min(wake, next_event_locked(now));
    budget_blocked = budget_blocked && next_seq_ == seq_at_block;
    cv_.wait_for(lock, std::chrono::nanoseconds(std::max<Nanos>(wake - now, 0)));
  }
  ++counters_.released[static_cast<size_t>(result.reason)];
  return result;
}

bool BatchQueue::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return false;
    const Entry e = it->second;
    remove_locked(id, e);
    cancelled_.push_back(id);
    ++counters_.cancelled;
  }
  cv_.notify_all();
  return true;
}

void BatchQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

bool BatchQueue::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::int64_t BatchQueue::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(entries_.size());
}

QueueStats BatchQueue::stats() const {
  const Nanos now = clock_->now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  QueueStats s = counters_;
  s.depth.assign(static_cast<size_t>(config_.priority_levels),
                 std::vector<std::int64_t>(bucket_count_, 0));
  for (size_t p = 0; p < s.depth.size(); ++p)
    for (size_t b = 0; b < bucket_count_; ++b) s.depth[p][b] = depth_[p * bucket_count_ + b];
  s.size = static_cast<std::int64_t>(entries_.size());
  s.queued_tokens = queued_tokens_;
  const Nanos oldest = oldest_enqueued_locked();
  s.oldest_wait_ns = oldest == kNever ? 0 : now - oldest;
  s.oldest_wait_ns_by_level.assign(static_cast<size_t>(config_.priority_levels), 0);
  for (size_t p = 0; p < s.oldest_wait_ns_by_level.size(); ++p)
    for (size_t b = 0; b < bucket_count_; ++b) {
      const auto& q = fifos_[p * bucket_count_ + b];
      if (!q.empty())
        s.oldest_wait_ns_by_level[p] =
            std::max(s.oldest_wait_ns_by_level[p], now - q.front().enqueued_ns);
    }
  return s;
}

}  // namespace streambatch
