// ladder.cpp: rungs from lengths, rung selection, padding statistics.
#include "workloads/rnnt/ladder.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "common/check.h"

namespace replay::rnnt {

namespace {

int64_t round_up(int64_t x, int64_t granule) {
  return (x + granule - 1) / granule * granule;
}

// Rungs may come out equal after rounding: keep one of each frame count, with the most labels.
std::vector<Rung> merge_equal(const std::vector<Rung>& rungs) {
  std::vector<Rung> merged;
  for (const Rung& r : rungs) {
    if (!merged.empty() && merged.back().max_frames == r.max_frames)
      merged.back().max_labels = std::max(merged.back().max_labels, r.max_labels);
    else
      merged.push_back(r);
  }
  return merged;
}

std::string str(int64_t v) {
  return std::to_string(v);
}

}  // namespace

Ladder::Ladder(std::vector<Rung> rungs) : rungs_(std::move(rungs)) {
  REPLAY_REQUIRE(!rungs_.empty(), "a ladder needs at least one rung");
  for (size_t i = 0; i < rungs_.size(); ++i) {
    const Rung& r = rungs_[i];
    REPLAY_REQUIRE(r.max_frames > 0 && r.max_labels >= 0,
                   "ladder rung " + str(i) + " (" + str(r.max_frames) + "x" + str(r.max_labels) +
                       "): frames must be positive and labels non-negative");
    if (i == 0) continue;
    const Rung& below = rungs_[i - 1];
    REPLAY_REQUIRE(r.max_frames > below.max_frames && r.max_labels >= below.max_labels,
                   "ladder rung " + str(i) + " (" + str(r.max_frames) + "x" + str(r.max_labels) +
                       ") is not above rung " + str(i - 1) + " (" + str(below.max_frames) + "x" +
                       str(below.max_labels) +
                       "): frames must increase and labels must not decrease");
  }
}

Ladder Ladder::from_lengths(const int32_t* frames, const int32_t* labels, int64_t n,
                            const LadderOptions& options) {
  REPLAY_REQUIRE(n > 0, "a ladder needs the lengths of at least one utterance");
  REPLAY_REQUIRE(options.rungs >= 1 && options.granule >= 1,
                 "a ladder needs at least one rung and a positive granule");
  const int64_t g = options.granule;
  std::vector<Rung> rungs;
  if (options.scheme == LadderScheme::kQuantile) {
    const int64_t k = std::min<int64_t>(options.rungs, n);
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return frames[a] < frames[b]; });
    std::vector<int64_t> sorted_frames(static_cast<size_t>(n)), most_labels(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      sorted_frames[j] = frames[order[j]];
      most_labels[j] = std::max<int64_t>(j > 0 ? most_labels[j - 1] : 0, labels[order[j]]);
    }
    for (int64_t group = 0; group < k; ++group) {
      const int64_t end = (group + 1) * (n / k) + std::min(group + 1, n % k);  // array_split
      const int64_t rung_frames = round_up(sorted_frames[end - 1], g);
      // The most labels of any utterance whose frames fit the rounded rung.
      const int64_t fit =
          std::upper_bound(sorted_frames.begin(), sorted_frames.end(), rung_frames) -
          sorted_frames.begin();
      rungs.push_back({rung_frames, round_up(most_labels[fit - 1], g)});
    }
  } else {
    const auto [min_t, max_t] = std::minmax_element(frames, frames + n);
    const auto [min_u, max_u] = std::minmax_element(labels, labels + n);
    const int64_t k = options.rungs;
    for (int64_t r = 1; r <= k; ++r) {
      const int64_t t = *min_t + (static_cast<int64_t>(*max_t - *min_t) * r + k - 1) / k;
      const int64_t u = *min_u + (static_cast<int64_t>(*max_u - *min_u) * r + k - 1) / k;
      rungs.push_back({round_up(t, g), round_up(u, g)});
    }
  }
  Rung& top = rungs.back();
  top.max_frames = std::max(top.max_frames, round_up(options.cover_frames, g));
  top.max_labels = std::max(top.max_labels, round_up(options.cover_labels, g));
  return Ladder(merge_equal(rungs));
}

Ladder Ladder::fit_to_batches(const std::vector<BatchLengths>& batches,
                              const LadderOptions& options) {
  REPLAY_REQUIRE(!batches.empty(), "a ladder fitted to batches needs batches");
  REPLAY_REQUIRE(options.rungs >= 1 && options.granule >= 1,
                 "a ladder needs at least one rung and a positive granule");
  const int64_t g = options.granule, nb = static_cast<int64_t>(batches.size());
  // Candidate rung values: the granule-rounded longest utterance of some batch, up to the top
  // (every batch and the covers). An optimal ladder needs no other value: lowering a rung to the
  // largest batch value it serves only lowers the cost.
  std::vector<int64_t> ts, us, batch_t(static_cast<size_t>(nb)), batch_u(static_cast<size_t>(nb));
  int64_t top_t = round_up(options.cover_frames, g), top_u = round_up(options.cover_labels, g);
  for (int64_t b = 0; b < nb; ++b) {
    REPLAY_REQUIRE(!batches[b].frames.empty(), "a ladder fitted to batches needs no empty batch");
    batch_t[b] = round_up(batches[b].max_frames(), g);
    batch_u[b] = round_up(batches[b].max_labels(), g);
    top_t = std::max(top_t, batch_t[b]);
    top_u = std::max(top_u, batch_u[b]);
    ts.push_back(batch_t[b]);
    us.push_back(batch_u[b]);
  }
  ts.push_back(top_t);
  us.push_back(top_u);
  for (std::vector<int64_t>* v : {&ts, &us}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const int64_t nt = static_cast<int64_t>(ts.size()), nu = static_cast<int64_t>(us.size());
  REPLAY_REQUIRE(nt * nu <= 4096, "fitting a ladder to " + str(nt) + " frame and " + str(nu) +
                                      " label values would be slow: use a larger granule");
  // slots[i][j]: the batches' slots at candidate (i, j), as 2-D prefix sums so that the slots of
  // any rectangle of candidates (i0, i1] x (j0, j1] come in O(1).
  std::vector<double> prefix(static_cast<size_t>((nt + 1) * (nu + 1)), 0.0);
  auto at = [&](int64_t i, int64_t j) -> double& { return prefix[(i + 1) * (nu + 1) + (j + 1)]; };
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = std::lower_bound(ts.begin(), ts.end(), batch_t[b]) - ts.begin();
    const int64_t j = std::lower_bound(us.begin(), us.end(), batch_u[b]) - us.begin();
    at(i, j) += static_cast<double>(batches[b].slots);
  }
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t j = 0; j < nu; ++j) at(i, j) += at(i - 1, j) + at(i, j - 1) - at(i - 1, j - 1);
  auto rect = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    return at(i1, j1) - at(i0, j1) - at(i1, j0) + at(i0, j0);
  };

  // Dynamic programming over the rungs, bottom up. A batch runs on the first rung that holds both
  // its frames and its labels; as both never decrease up the ladder, the batches still waiting
  // above a rung (i, j) are those with labels above j among the frames up to i, plus all with
  // frames above i. So the state is the previous rung, -1 before the first. best[k][s]: the least
  // padded lattice (slots x T x (U + 1)) of the waiting batches with k rungs left, from state s.
  const int64_t states = (nt + 1) * (nu + 1), top = states - 1;
  auto state = [&](int64_t i, int64_t j) { return (i + 1) * (nu + 1) + (j + 1); };
  const double kInf = INFINITY;
  const int64_t levels = std::min<int64_t>(options.rungs, nt);
  std::vector<std::vector<double>> best(static_cast<size_t>(levels + 1),
                                        std::vector<double>(static_cast<size_t>(states), kInf));
  std::vector<std::vector<int64_t>> next(static_cast<size_t>(levels + 1),
                                         std::vector<int64_t>(static_cast<size_t>(states), -1));
  best[0][top] = 0;
  for (int64_t k = 1; k <= levels; ++k) {
    best[k][top] = 0;
    for (int64_t ip = -1; ip < nt; ++ip) {
      for (int64_t jp = -1; jp < nu; ++jp) {
        const int64_t from = state(ip, jp);
        if (from == top || (ip < 0) != (jp < 0)) continue;
        for (int64_t i = ip + 1; i < nt; ++i) {
          for (int64_t j = std::max<int64_t>(jp, 0); j < nu; ++j) {
            const double rest = best[k - 1][state(i, j)];
            if (rest == kInf) continue;
            const double slots = rect(-1, ip, jp, j) + rect(ip, i, -1, j);
            const double total = slots * static_cast<double>(ts[i] * (us[j] + 1)) + rest;
            if (total < best[k][from]) {
              best[k][from] = total;
              next[k][from] = state(i, j);
            }
          }
        }
      }
    }
  }
  std::vector<Rung> rungs;
  for (int64_t k = levels, s = state(-1, -1); s != top; --k) {
    s = next[k][s];
    const int64_t i = s / (nu + 1) - 1, j = s % (nu + 1) - 1;
    rungs.push_back({ts[i], us[j]});
  }
  // A rung no batch runs on would only cost a capture: drop it (never the top).
  const Ladder fitted(rungs);
  std::vector<int64_t> used(rungs.size(), 0);
  for (int64_t b = 0; b < nb; ++b) ++used[fitted.find(batch_t[b], batch_u[b])];
  std::vector<Rung> kept;
  for (size_t r = 0; r < rungs.size(); ++r)
    if (used[r] > 0 || r + 1 == rungs.size()) kept.push_back(rungs[r]);
  return Ladder(kept);
}

int Ladder::find(int64_t frames, int64_t labels) const {
  for (int i = 0; i < size(); ++i) {
    if (frames <= rungs_[i].max_frames && labels <= rungs_[i].max_labels) return i;
  }
  return -1;
}

int Ladder::select(int64_t frames, int64_t labels) const {
  const int rung = find(frames, labels);
  REPLAY_REQUIRE(rung >= 0, "a batch of " + str(frames) + " frames and " + str(labels) +
                                " labels does not fit the ladder's top rung (" +
                                str(top().max_frames) + " frames, " + str(top().max_labels) +
                                " labels)");
  return rung;
}

std::string Ladder::describe() const {
  std::string text = str(size()) + (size() == 1 ? " rung" : " rungs") + " (frames x labels):";
  for (const Rung& r : rungs_) text += " " + str(r.max_frames) + "x" + str(r.max_labels);
  return text;
}

int64_t BatchLengths::max_frames() const {
  return frames.empty() ? 0 : *std::max_element(frames.begin(), frames.end());
}

int64_t BatchLengths::max_labels() const {
  return labels.empty() ? 0 : *std::max_element(labels.begin(), labels.end());
}

void PaddingStats::add(const BatchLengths& batch, const Rung& shape, int rung) {
  REPLAY_REQUIRE(batch.frames.size() == batch.labels.size() &&
                     static_cast<int64_t>(batch.frames.size()) <= batch.slots,
                 "a batch's lengths must pair up and fit its slots");
  ++batches;
  slots += batch.slots;
  utterances += static_cast<int64_t>(batch.frames.size());
  for (size_t i = 0; i < batch.frames.size(); ++i) {
    real_frames += batch.frames[i];
    real_labels += batch.labels[i];
    real_lattice += static_cast<int64_t>(batch.frames[i]) * (batch.labels[i] + 1);
  }
  padded_frames += batch.slots * shape.max_frames;
  padded_labels += batch.slots * shape.max_labels;
  padded_lattice += batch.slots * shape.max_frames * (shape.max_labels + 1);
  if (rung >= 0) {
    if (batches_per_rung.size() <= static_cast<size_t>(rung))
      batches_per_rung.resize(static_cast<size_t>(rung) + 1, 0);
    ++batches_per_rung[rung];
  }
}

double PaddingStats::frame_ratio() const {
  return real_frames > 0 ? static_cast<double>(padded_frames) / real_frames : 0.0;
}

double PaddingStats::label_ratio() const {
  return real_labels > 0 ? static_cast<double>(padded_labels) / real_labels : 0.0;
}

double PaddingStats::lattice_ratio() const {
  return real_lattice > 0 ? static_cast<double>(padded_lattice) / real_lattice : 0.0;
}

std::string PaddingStats::describe() const {
  char text[256];
  std::snprintf(text, sizeof text,
                "%lld batches, %lld utterances: padded/real frames %.3f, labels %.3f, "
                "lattice T x (U+1) %.3f",
                static_cast<long long>(batches), static_cast<long long>(utterances), frame_ratio(),
                label_ratio(), lattice_ratio());
  std::string out = text;
  if (!batches_per_rung.empty()) {
    out += "; batches per rung:";
    for (int64_t b : batches_per_rung) out += " " + str(b);
  }
  return out;
}

PaddingStats ladder_padding(const Ladder& ladder, const std::vector<BatchLengths>& batches) {
  PaddingStats stats;
  stats.batches_per_rung.assign(static_cast<size_t>(ladder.size()), 0);
  for (const BatchLengths& b : batches) {
    const int rung = ladder.select(b.max_frames(), b.max_labels());
    stats.add(b, ladder[rung], rung);
  }
  return stats;
}

PaddingStats exact_padding(const std::vector<BatchLengths>& batches) {
  PaddingStats stats;
  for (const BatchLengths& b : batches) stats.add(b, {b.max_frames(), b.max_labels()});
  return stats;
}

LengthStats length_stats(const int32_t* lengths, int64_t n) {
  LengthStats s;
  if (n <= 0) return s;
  std::vector<int32_t> sorted(lengths, lengths + n);
  std::sort(sorted.begin(), sorted.end());
  s.count = n;
  s.min = sorted.front();
  s.max = sorted.back();
  s.mean = std::accumulate(sorted.begin(), sorted.end(), 0.0) / static_cast<double>(n);
  auto rank = [&](int64_t percent) {  // the ceil(percent * n / 100)-th smallest, in integers
    const int64_t k = std::max<int64_t>(1, (percent * n + 99) / 100);
    return static_cast<int64_t>(sorted[static_cast<size_t>(k - 1)]);
  };
  s.p10 = rank(10);
  s.p50 = rank(50);
  s.p90 = rank(90);
  s.p99 = rank(99);
  return s;
}

}  // namespace replay::rnnt
