#include "batch_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

using namespace streambatch;

namespace {

constexpr Nanos kMs = 1'000'000;

struct Fixture {
  std::shared_ptr<ManualClock> clock = std::make_shared<ManualClock>(1'000 * kMs);
  QueueConfig config;
  Fixture() {
    config.max_wait_ns = 0;
    config.batch_window_ns = 0;
    config.release_on_urgent = false;
  }
  BatchQueue make() { return BatchQueue(config, clock); }
};

void push_ok(BatchQueue& q, RequestId id, std::int64_t prompt, int prio = 0, Nanos deadline = 0,
             std::int64_t max_new = 1) {
  ASSERT_EQ(q.push(id, prompt, max_new, prio, deadline).status, PushStatus::kAccepted) << id;
}

// Newest first after 100 ms of waiting, for a backlog of more than a second of admissions.
Fixture backlog_fixture() {
  Fixture f;
  f.config.lifo_after_ns = 100 * kMs;
  f.config.lifo_backlog_ns = 1'000 * kMs;
  return f;
}

// One second after the queue began, requests 1..count enter it at once.
void admit_at_one_second(Fixture& f, BatchQueue& q, RequestId count) {
  f.clock->advance_ns(1'000 * kMs);
  for (RequestId i = 1; i <= count; ++i) push_ok(q, i, 10);
  ASSERT_EQ(q.pop_batch(count, 1000, 0).admitted.size(), static_cast<size_t>(count));
}

}  // namespace

TEST(BatchQueue, PriorityFirstThenFifo) {
  Fixture f;
  auto q = f.make();
  push_ok(q, 1, 10, 0);
  push_ok(q, 2, 10, 1);
  push_ok(q, 3, 10, 0);
  push_ok(q, 4, 10, 1);
  auto r = q.pop_batch(10, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2, 4, 1, 3}));
  EXPECT_EQ(r.reason, ReleaseReason::kWindow);
}

TEST(BatchQueue, BucketsFillHeadBucketThenNearest) {
  Fixture f;
  f.config.priority_levels = 1;
  f.config.bucket_bounds = {16, 64, 256};  // buckets: <=16, <=64, <=256, >256
  auto q = f.make();
  push_ok(q, 1, 100);  // bucket 2, the head
  push_ok(q, 2, 10);   // bucket 0
  push_ok(q, 3, 500);  // bucket 3
  push_ok(q, 4, 50);   // bucket 1
  push_ok(q, 5, 200);  // bucket 2
  auto r = q.pop_batch(10, 100000, 0);
  // Head bucket 2 first (FIFO), then distance 1 (bucket 1 before bucket 3), then bucket 0.
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 5, 4, 3, 2}));
}

TEST(BatchQueue, PriorityOutranksBuckets) {
  Fixture f;
  f.config.bucket_bounds = {16};
  auto q = f.make();
  push_ok(q, 1, 100, 1);  // head: high, long bucket
  push_ok(q, 2, 200, 0);  // low, same bucket as head
  push_ok(q, 3, 5, 1);    // high, other bucket
  auto r = q.pop_batch(10, 100000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 3, 2}));
}

TEST(BatchQueue, TokenBudgetStopsWithoutOvertaking) {
  Fixture f;
  auto q = f.make();
  push_ok(q, 1, 40, 0, 0, 10);  // cost 50
  push_ok(q, 2, 90, 0, 0, 10);  // cost 100
  push_ok(q, 3, 5, 0, 0, 5);    // cost 10
  auto r = q.pop_batch(10, 120, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));  // 2 does not fit; 3 may not overtake it
  r = q.pop_batch(10, 120, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2, 3}));
}

TEST(BatchQueue, MaxRequestsAndFullRule) {
  Fixture f;
  f.config.batch_window_ns = 10'000 * kMs;  // the window alone would hold them
  auto q = f.make();
  for (RequestId i = 0; i < 5; ++i) push_ok(q, i, 1);
  auto r = q.pop_batch(3, 1000, 0);
  EXPECT_EQ(r.reason, ReleaseReason::kFull);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{0, 1, 2}));
  r = q.pop_batch(3, 1000, 0);  // two left, window not expired: nothing yet
  EXPECT_TRUE(r.admitted.empty());
  EXPECT_EQ(r.reason, ReleaseReason::kTimeout);
}

TEST(BatchQueue, WindowAndMaxWait) {
  Fixture f;
  f.config.batch_window_ns = 20 * kMs;
  f.config.max_wait_ns = 50 * kMs;
  auto q = f.make();
  push_ok(q, 1, 1);
  EXPECT_TRUE(q.pop_batch(8, 1000, 0).admitted.empty());
  f.clock->advance_ns(20 * kMs);
  auto r = q.pop_batch(1, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));
  EXPECT_EQ(r.reason, ReleaseReason::kFull);  // one slot asked, one queued

  push_ok(q, 2, 1);
  f.clock->advance_ns(20 * kMs);
  push_ok(q, 3, 1);
  r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.reason, ReleaseReason::kWindow);
  EXPECT_EQ(r.admitted.size(), 2u);
}

TEST(BatchQueue, MaxWaitFiresWhenWindowKeepsReopening) {
  Fixture f;
  f.config.batch_window_ns = 40 * kMs;
  f.config.max_wait_ns = 50 * kMs;
  auto q = f.make();
  push_ok(q, 1, 60, 0, 0, 10);  // cost 70
  push_ok(q, 2, 60, 0, 0, 10);
  f.clock->advance_ns(40 * kMs);
  auto r = q.pop_batch(8, 100, 0);  // budget for one: the window reopens for request 2
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));
  f.clock->advance_ns(10 * kMs);  // window (reopened 10 ms ago) not expired; 2 waited 50 ms
  r = q.pop_batch(8, 100, 0);
  EXPECT_EQ(r.reason, ReleaseReason::kMaxWait);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2}));
}

TEST(BatchQueue, UrgentArrivalReleasesAtOnce) {
  Fixture f;
  f.config.batch_window_ns = 1'000 * kMs;
  f.config.release_on_urgent = true;
  auto q = f.make();
  push_ok(q, 1, 1, 0);
  EXPECT_TRUE(q.pop_batch(8, 1000, 0).admitted.empty());
  push_ok(q, 2, 1, 1);
  auto r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.reason, ReleaseReason::kUrgent);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2, 1}));
}

TEST(BatchQueue, DeadlinesExpireWhileQueued) {
  Fixture f;
  f.config.batch_window_ns = 1'000 * kMs;
  auto q = f.make();
  const Nanos now = f.clock->now_ns();
  push_ok(q, 1, 1, 0, now + 10 * kMs);
  push_ok(q, 2, 1, 0, now + 100 * kMs);
  push_ok(q, 3, 1, 0, 0);
  f.clock->advance_ns(10 * kMs);
  auto r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.expired, (std::vector<RequestId>{1}));
  EXPECT_TRUE(r.admitted.empty());
  EXPECT_EQ(r.reason, ReleaseReason::kEvicted);
  f.clock->advance_ns(1'000 * kMs);
  r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.expired, (std::vector<RequestId>{2}));
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{3}));
  EXPECT_EQ(q.stats().expired, 2);
}

TEST(BatchQueue, AgingPromotesOneLevelPerInterval) {
  Fixture f;
  f.config.priority_levels = 3;
  f.config.aging_interval_ns = 100 * kMs;
  auto q = f.make();
  push_ok(q, 1, 1, 0);
  f.clock->advance_ns(100 * kMs);  // 1 is now effectively level 1
  push_ok(q, 2, 1, 1);
  push_ok(q, 3, 1, 2);
  auto r = q.pop_batch(8, 1000, 0);
  // Level 2: {3}; level 1: {1 (aged, older), 2}.
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{3, 1, 2}));

  push_ok(q, 4, 1, 0);
  f.clock->advance_ns(250 * kMs);  // two intervals: level 0 -> 1 (capped below the top)
  push_ok(q, 6, 1, 1);
  push_ok(q, 5, 1, 2);
  r = q.pop_batch(8, 1000, 0);
  // The urgent request first however long 4 waited; 4 (aged to level 1, older) before 6.
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{5, 4, 6}));
}

TEST(BatchQueue, OverloadedLevelIsServedNewestFirstRequeuedStillFirst) {
  Fixture f;
  f.config.lifo_after_ns = 100 * kMs;
  auto q = f.make();
  const Nanos first_arrival = f.clock->now_ns();
  push_ok(q, 1, 10, 0);
  f.clock->advance_ns(50 * kMs);
  push_ok(q, 2, 10, 0);
  push_ok(q, 3, 10, 0);
  auto r = q.pop_batch(1, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));  // oldest waited 50 ms: arrival order

  f.clock->advance_ns(100 * kMs);  // 2 has waited 100 ms: level 0 is overloaded
  push_ok(q, 4, 10, 0);
  push_ok(q, 5, 10, 0);
  push_ok(q, 6, 10, 1);  // level 1 is not: its own order, and before level 0 anyway
  EXPECT_TRUE(q.cancel(5));  // a dead tail is skipped, not taken
  r = q.pop_batch(3, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{6, 4, 3}));
  EXPECT_EQ(r.cancelled, (std::vector<RequestId>{5}));

  push_ok(q, 7, 10, 0);
  ASSERT_EQ(q.requeue(1, 15, 5, 0, 0, first_arrival).status, PushStatus::kAccepted);
  r = q.pop_batch(3, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 7, 2}));  // the preempted one resumes first
}

TEST(BatchQueue, ARequeuedOrCancelledRequestAloneDoesNotTurnItsLevelNewestFirst) {
  Fixture f;
  f.config.lifo_after_ns = 100 * kMs;
  auto q = f.make();
  const Nanos long_ago = f.clock->now_ns();
  push_ok(q, 1, 10, 0);
  auto r = q.pop_batch(1, 1000, 0);  // 1 runs ...
  ASSERT_EQ(r.admitted, (std::vector<RequestId>{1}));
  f.clock->advance_ns(500 * kMs);
  push_ok(q, 2, 10, 0);  // ... an old arrival, cancelled, sits behind the requeued one
  f.clock->advance_ns(200 * kMs);
  push_ok(q, 3, 10, 0);
  push_ok(q, 4, 10, 0);
  // 1 was preempted after running 700 ms: its wait counts from its first arrival. Then 2 is
  // cancelled: a dead slot behind the requeued front, not dropped as a head.
  ASSERT_EQ(q.requeue(1, 15, 5, 0, 0, long_ago).status, PushStatus::kAccepted);
  EXPECT_TRUE(q.cancel(2));
  r = q.pop_batch(3, 1000, 0);
  // Only 1 (requeued) and 2 (cancelled) are old: arrival order, 1 first as requeued.
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 3, 4}));
}

TEST(BatchQueue, CapacityTotalAndPerLevel) {
  Fixture f;
  f.config.capacity = 3;
  f.config.level_capacity = {2, 0};
  auto q = f.make();
  push_ok(q, 1, 1, 0);
  push_ok(q, 2, 1, 0);
  auto r = q.push(3, 1, 1, 0, 0);
  EXPECT_EQ(r.status, PushStatus::kQueueFull);
  EXPECT_EQ(r.reason, "level");
  push_ok(q, 4, 1, 1);
  r = q.push(5, 1, 1, 1, 0);
  EXPECT_EQ(r.status, PushStatus::kQueueFull);
  EXPECT_EQ(r.reason, "total");
  EXPECT_EQ(q.stats().rejected_full, 2);
}

TEST(BatchQueue, RequeueGoesFirstIgnoresCapacityAndKeepsItsWait) {
  Fixture f;
  f.config.capacity = 2;
  f.config.aging_interval_ns = 0;
  auto q = f.make();
  const Nanos first_arrival = f.clock->now_ns();
  push_ok(q, 1, 10, 0);
  f.clock->advance_ns(5 * kMs);
  push_ok(q, 2, 10, 0);
  auto r = q.pop_batch(1, 1000, 0);
  ASSERT_EQ(r.admitted, (std::vector<RequestId>{1}));
  push_ok(q, 3, 10, 0);  // fills the queue together with 2
  EXPECT_EQ(q.push(9, 10, 1, 0, 0).status, PushStatus::kQueueFull);
  // 1 was preempted: back in front of 2 and 3 although the queue is full.
  EXPECT_EQ(q.requeue(1, 15, 5, 0, 0, first_arrival).status, PushStatus::kAccepted);
  EXPECT_EQ(q.requeue(1, 15, 5, 0, 0, first_arrival).status, PushStatus::kDuplicateId);
  f.clock->advance_ns(10 * kMs);
  const auto s = q.stats();
  EXPECT_EQ(s.requeued, 1);
  EXPECT_EQ(s.size, 3);
  EXPECT_EQ(s.oldest_wait_ns_by_level[0], 15 * kMs);
  EXPECT_EQ(s.oldest_wait_ns_by_level[1], 0);
  r = q.pop_batch(10, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 2, 3}));
  EXPECT_EQ(q.requeue(4, -1, 1, 0, 0, 0).status, PushStatus::kInvalid);
}

TEST(BatchQueue, InvalidAndDuplicate) {
  Fixture f;
  f.config.max_batch_tokens = 100;
  auto q = f.make();
  EXPECT_EQ(q.push(-1, 1, 1, 0, 0).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, -1, 1, 0, 0).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, 1, -5, 0, 0).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, 1, 1, 2, 0).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, 1, 1, -1, 0).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, 1, 1, 0, -3).status, PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, std::int64_t{1} << 62, std::int64_t{1} << 62, 0, 0).status,
            PushStatus::kInvalid);
  EXPECT_EQ(q.push(1, 90, 20, 0, 0).status, PushStatus::kInvalid);  // can never fit a batch
  push_ok(q, 1, 1);
  EXPECT_EQ(q.push(1, 1, 1, 0, 0).status, PushStatus::kDuplicateId);
  EXPECT_EQ(q.stats().rejected_invalid, 8);
  QueueConfig descending;
  descending.bucket_bounds = {10, 5};
  EXPECT_THROW(BatchQueue{descending}, std::invalid_argument);
}

TEST(BatchQueue, CancelReportsAndFreesTheId) {
  Fixture f;
  auto q = f.make();
  push_ok(q, 1, 1);
  push_ok(q, 2, 1);
  EXPECT_TRUE(q.cancel(1));
  EXPECT_FALSE(q.cancel(1));
  EXPECT_FALSE(q.cancel(99));
  auto r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.cancelled, (std::vector<RequestId>{1}));
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2}));
  push_ok(q, 1, 1);  // the id may be reused once gone
  EXPECT_EQ(q.pop_batch(8, 1000, 0).admitted, (std::vector<RequestId>{1}));
}

TEST(BatchQueue, ManyCancelsCompactTombstones) {
  Fixture f;
  auto q = f.make();
  for (RequestId i = 0; i < 1000; ++i) push_ok(q, i, 1);
  for (RequestId i = 1; i < 999; ++i) EXPECT_TRUE(q.cancel(i));
  auto r = q.pop_batch(8, 1000, 0);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{0, 999}));
  EXPECT_EQ(r.cancelled.size(), 998u);
  EXPECT_EQ(q.size(), 0);
}

TEST(BatchQueue, CloseWakesWaitersAndDrains) {
  QueueConfig c;
  c.batch_window_ns = 10'000 * kMs;
  c.max_wait_ns = 0;
  c.release_on_urgent = false;
  BatchQueue q(c);
  push_ok(q, 1, 1);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    q.close();
  });
  auto r = q.pop_batch(8, 1000, 5'000 * kMs);
  closer.join();
  EXPECT_EQ(r.reason, ReleaseReason::kClosed);
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));
  EXPECT_EQ(q.push(2, 1, 1, 0, 0).status, PushStatus::kClosed);
  r = q.pop_batch(8, 1000, 5'000 * kMs);  // returns at once
  EXPECT_EQ(r.reason, ReleaseReason::kClosed);
  EXPECT_TRUE(r.admitted.empty());
}

TEST(BatchQueue, BlockingPopWakesOnPushAndTimesOut) {
  QueueConfig c;
  c.max_wait_ns = 0;
  BatchQueue q(c);
  auto t0 = std::chrono::steady_clock::now();
  auto r = q.pop_batch(8, 1000, 30 * kMs);
  EXPECT_EQ(r.reason, ReleaseReason::kTimeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(30));
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    push_ok(q, 7, 1);
  });
  r = q.pop_batch(8, 1000, 5'000 * kMs);
  producer.join();
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{7}));
}

TEST(BatchQueue, BlockingPopWakesAtWindowExpiry) {
  QueueConfig c;
  c.batch_window_ns = 30 * kMs;
  c.max_wait_ns = 0;
  BatchQueue q(c);
  push_ok(q, 1, 1);
  auto t0 = std::chrono::steady_clock::now();
  auto r = q.pop_batch(8, 1000, 5'000 * kMs);
  auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(r.reason, ReleaseReason::kWindow);
  EXPECT_GE(waited, std::chrono::milliseconds(25));
  EXPECT_LT(waited, std::chrono::milliseconds(2'000));
}

TEST(BatchQueue, StatsDepthPerLevelAndBucket) {
  Fixture f;
  f.config.bucket_bounds = {16};
  auto q = f.make();
  push_ok(q, 1, 5, 0);
  push_ok(q, 2, 50, 1);
  push_ok(q, 3, 60, 1);
  f.clock->advance_ns(7 * kMs);
  auto s = q.stats();
  EXPECT_EQ(s.depth, (std::vector<std::vector<std::int64_t>>{{1, 0}, {0, 2}}));
  EXPECT_EQ(s.size, 3);
  EXPECT_EQ(s.oldest_wait_ns, 7 * kMs);
  EXPECT_EQ(s.accepted, 3);
}

TEST(BatchQueue, MultiProducerStressLosesAndDuplicatesNothing) {
  QueueConfig c;
  c.capacity = 1 << 20;
  c.max_wait_ns = 1 * kMs;
  c.batch_window_ns = 0;
  c.priority_levels = 4;
  c.bucket_bounds = {8, 32, 128};
  c.aging_interval_ns = 1 * kMs;
  BatchQueue q(c);
  constexpr int kProducers = 4;
  constexpr int kPerProducer = 20'000;
  std::atomic<int> producers_done{0};
  std::vector<std::thread> producers;
  std::vector<std::vector<RequestId>> cancelled_by(kProducers);
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        const RequestId id = static_cast<RequestId>(p) * kPerProducer + i;
        const Nanos deadline = (i % 7 == 0) ? q.now_ns() + 200'000 : 0;  // some expire
        while (q.push(id, 1 + (i * 13) % 200, 1 + i % 5, i % 4, deadline).status !=
               PushStatus::kAccepted) {
        }
        if (i % 11 == 0 && q.cancel(id)) cancelled_by[static_cast<size_t>(p)].push_back(id);
      }
      producers_done.fetch_add(1);
    });
  }
  std::vector<RequestId> seen_admitted, seen_expired, seen_cancelled;
  while (producers_done.load() < kProducers || q.size() > 0) {
    auto r = q.pop_batch(64, 1 << 20, 2 * kMs);
    seen_admitted.insert(seen_admitted.end(), r.admitted.begin(), r.admitted.end());
    seen_expired.insert(seen_expired.end(), r.expired.begin(), r.expired.end());
    seen_cancelled.insert(seen_cancelled.end(), r.cancelled.begin(), r.cancelled.end());
  }
  auto tail = q.pop_batch(64, 1 << 20, 0);  // cancellations reported after the last pop
  seen_cancelled.insert(seen_cancelled.end(), tail.cancelled.begin(), tail.cancelled.end());
  for (auto& t : producers) t.join();

  std::set<RequestId> all;
  for (auto* v : {&seen_admitted, &seen_expired, &seen_cancelled})
    for (RequestId id : *v) EXPECT_TRUE(all.insert(id).second) << "duplicate id " << id;
  EXPECT_EQ(all.size(), static_cast<size_t>(kProducers * kPerProducer));
  size_t cancelled_expected = 0;
  for (auto& v : cancelled_by) cancelled_expected += v.size();
  EXPECT_EQ(seen_cancelled.size(), cancelled_expected);
  auto s = q.stats();
  EXPECT_EQ(s.admitted + s.expired + s.cancelled, kProducers * kPerProducer);
}

TEST(BatchQueue, PreferredGoFirstWithinTheirLevel) {
  Fixture f;
  f.config.affinity_max_overtakes = 8;
  auto q = f.make();
  push_ok(q, 1, 10, 0);
  push_ok(q, 2, 10, 0);
  push_ok(q, 3, 10, 0);
  push_ok(q, 4, 10, 1);
  push_ok(q, 5, 10, 0);
  // Level 1 outranks the preferred ones; among level 0 the preferred go first, oldest first;
  // an unknown id is ignored.
  auto r = q.pop_batch(10, 1000, 0, {5, 3, 99});
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{4, 3, 5, 1, 2}));
  EXPECT_EQ(q.size(), 0);
}

TEST(BatchQueue, AffinityLimitBoundsTheOvertaking) {
  Fixture f;
  f.config.affinity_max_overtakes = 2;
  auto q = f.make();
  for (RequestId id = 1; id <= 4; ++id) push_ok(q, id, 10);
  // Request 1 is next in line; it is passed over twice, across pops, then goes first.
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {3}).admitted, (std::vector<RequestId>{3}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {4}).admitted, (std::vector<RequestId>{4}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {2}).admitted, (std::vector<RequestId>{1}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {}).admitted, (std::vector<RequestId>{2}));
}

TEST(BatchQueue, PreferenceNeedsAnOvertakeLimit) {
  Fixture f;  // affinity_max_overtakes = 0: preferred requests pass nobody
  auto q = f.make();
  push_ok(q, 1, 10);
  push_ok(q, 2, 10);
  auto r = q.pop_batch(10, 1000, 0, {2});
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1, 2}));
}

TEST(BatchQueue, PreferredRequestThatDoesNotFitPassesNobody) {
  Fixture f;
  f.config.affinity_max_overtakes = 8;
  auto q = f.make();
  push_ok(q, 1, 10);
  push_ok(q, 2, 200);
  // The preferred request 2 does not fit: the order goes on without it.
  auto r = q.pop_batch(10, 100, 0, {2});
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{1}));
  r = q.pop_batch(10, 1000, 0, {2});
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{2}));
}

TEST(BatchQueue, RequeuedRequestIsNeverPassedOver) {
  Fixture f;
  f.config.affinity_max_overtakes = 8;
  auto q = f.make();
  push_ok(q, 1, 10);
  push_ok(q, 2, 10);
  ASSERT_EQ(q.requeue(100, 10, 1, 0, 0, f.clock->now_ns()).status, PushStatus::kAccepted);
  // The preempted request resumes first; then the preferred one passes request 1.
  auto r = q.pop_batch(10, 1000, 0, {2});
  EXPECT_EQ(r.admitted, (std::vector<RequestId>{100, 2, 1}));
}

TEST(BatchQueue, NewestFirstServesOverdueRequestsOldestFirst) {
  Fixture f;
  f.config.lifo_after_ns = 100 * kMs;
  f.config.oldest_first_after_ns = 1'000 * kMs;
  auto q = f.make();
  push_ok(q, 1, 10);
  push_ok(q, 2, 10);
  f.clock->advance_ns(500 * kMs);
  push_ok(q, 3, 10);
  push_ok(q, 4, 10);
  // Backlogged (the oldest waited 500 ms), nobody overdue yet: newest first.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{4}));
  f.clock->advance_ns(500 * kMs);  // 1 and 2 have waited 1 s: overdue, oldest first
  push_ok(q, 5, 10);
  EXPECT_EQ(q.pop_batch(3, 1000, 0).admitted, (std::vector<RequestId>{1, 2, 5}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{3}));
}

// Newest first after 100 ms, overdue after 1 s and `turns` times the requests ahead leaving.
Fixture turns_fixture(double turns) {
  Fixture f;
  f.config.lifo_after_ns = 100 * kMs;
  f.config.oldest_first_after_ns = 1'000 * kMs;
  f.config.oldest_first_turns = turns;
  return f;
}

TEST(BatchQueue, OverdueAlsoWaitsOutItsTurns) {
  Fixture f = turns_fixture(4);
  auto q = f.make();
  // Due after 0, 4, 8 and 12 departures: 0, 1, 2 and 3 requests were waiting ahead of them.
  for (RequestId id = 1; id <= 4; ++id) push_ok(q, id, 10);
  f.clock->advance_ns(500 * kMs);
  push_ok(q, 5, 10);
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{5}));  // newest first
  f.clock->advance_ns(600 * kMs);  // 1-4 have waited 1.1 s
  // 1 had nobody ahead: overdue. 2 has waited as long but only 2 of its 4 turns have left:
  // newest first goes on (with the time alone: 1, 2, 3 in arrival order).
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{1}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{4}));
  push_ok(q, 6, 10);
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{6}));
  EXPECT_EQ(q.pop_batch(2, 1000, 0).admitted, (std::vector<RequestId>{2, 3}));  // 2: 4 admitted
}

TEST(BatchQueue, TurnsCountCancelledRequestsAheadAsGone) {
  Fixture f = turns_fixture(2);
  auto q = f.make();
  for (RequestId id = 1; id <= 3; ++id) push_ok(q, id, 10);  // due after 0, 2, 4 departures
  EXPECT_TRUE(q.cancel(1));                                   // 1 departure
  f.clock->advance_ns(1'100 * kMs);
  push_ok(q, 4, 10);
  // 2 has waited 1.1 s, but only 1 of its 2 turns has left: newest first.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{4}));
  // The cancelled one and one admission: 2's turns are over (counting admissions alone, 3).
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{2}));
}

TEST(BatchQueue, TurnsOfRequestsGoneLeaveNoMark) {
  Fixture f = turns_fixture(2);
  auto q = f.make();
  for (RequestId id = 1; id <= 3; ++id) push_ok(q, id, 10);  // due after 0, 2, 4 departures
  f.clock->advance_ns(200 * kMs);
  for (RequestId id : {3, 2, 1})  // newest first, until none is left
    EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{id}));
  // The FIFO is empty: 4 has nobody ahead and is due at once (3 departures), not after 3's 4.
  push_ok(q, 4, 10);
  f.clock->advance_ns(1'100 * kMs);
  push_ok(q, 5, 10);
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{4}));  // overdue: first
}

TEST(BatchQueue, OverdueRequestIsNeverPassedOver) {
  Fixture f;
  f.config.affinity_max_overtakes = 8;
  f.config.oldest_first_after_ns = 1'000 * kMs;
  auto q = f.make();
  push_ok(q, 1, 10);
  f.clock->advance_ns(999 * kMs);
  push_ok(q, 2, 10);
  push_ok(q, 3, 10);
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {3}).admitted, (std::vector<RequestId>{3}));
  f.clock->advance_ns(1 * kMs);  // 1 has waited 1 s: the preferred 2 waits behind it
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {2}).admitted, (std::vector<RequestId>{1}));
  EXPECT_EQ(q.pop_batch(1, 1000, 0, {}).admitted, (std::vector<RequestId>{2}));
}

TEST(BatchQueue, NewestFirstOnlyForABacklogArrivalOrderCannotClearSoon) {
  Fixture f = backlog_fixture();
  auto q = f.make();
  admit_at_one_second(f, q, 4);
  for (RequestId i = 11; i <= 14; ++i) push_ok(q, i, 10);
  f.clock->advance_ns(500 * kMs);
  // The oldest waited 500 ms, but the 4 waiting are no more than the 4 admitted in the last
  // second: arrival order clears them within a second, so it stays.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{11}));
  for (RequestId i = 15; i <= 17; ++i) push_ok(q, i, 10);
  // 6 waiting, 5 admitted in the last second: newest first.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{17}));
  // 600 ms on, only the 2 admissions of 600 ms ago are in the last second: 5 waiting are
  // still more; after those two, 3 waiting are fewer than the 4 admitted: arrival order.
  f.clock->advance_ns(600 * kMs);
  EXPECT_EQ(q.pop_batch(2, 1000, 0).admitted, (std::vector<RequestId>{16, 15}));
  EXPECT_EQ(q.pop_batch(2, 1000, 0).admitted, (std::vector<RequestId>{12, 13}));
}

TEST(BatchQueue, HigherLevelsCountInALowerLevelsBacklog) {
  Fixture f = backlog_fixture();
  auto q = f.make();
  admit_at_one_second(f, q, 3);  // 3 admitted in the last second
  push_ok(q, 11, 10, 0);
  push_ok(q, 12, 10, 0);
  push_ok(q, 21, 10, 1);
  push_ok(q, 22, 10, 1);
  f.clock->advance_ns(500 * kMs);
  // The high level's 2 clear within a second (arrival order); the low level waits behind
  // them too: 4 in all, more than a second of admissions, so newest first.
  EXPECT_EQ(q.pop_batch(4, 1000, 0).admitted, (std::vector<RequestId>{21, 22, 12, 11}));
}

TEST(BatchQueue, RequeuedRequestsCountInTheBacklogAndAsAdmissions) {
  Fixture f = backlog_fixture();
  auto q = f.make();
  admit_at_one_second(f, q, 2);  // 2 admitted in the last second
  for (RequestId i = 11; i <= 13; ++i) push_ok(q, i, 10);
  f.clock->advance_ns(500 * kMs);
  ASSERT_EQ(q.requeue(100, 10, 1, 0, 0, f.clock->now_ns()).status, PushStatus::kAccepted);
  // 4 waiting with the requeued one: newest first, but a requeued request resumes first.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{100}));
  // Its re-admission counts: 3 waiting, 3 admitted in the last second, arrival order.
  EXPECT_EQ(q.pop_batch(1, 1000, 0).admitted, (std::vector<RequestId>{11}));
}

TEST(BatchQueue, BacklogSpanIsBounded) {
  QueueConfig c;
  c.lifo_backlog_ns = kMaxLifoBacklogNs + 1;
  EXPECT_THROW(BatchQueue{c}, std::invalid_argument);
  c.lifo_backlog_ns = -1;
  EXPECT_THROW(BatchQueue{c}, std::invalid_argument);
}
