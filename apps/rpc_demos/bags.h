#pragma once
// The bag-of-tokens task of the split-model and DDP + RPC demos: each bag of token ids belongs
// to the class whose token range most of its tokens come from, so a model that embeds the bags
// and classifies them can learn it.

#include <ATen/ATen.h>

#include <cstdint>

namespace tdist::demo::bags {

constexpr int64_t kVocab = 200, kClasses = 4, kBagLength = 8;

struct Batch {
  at::Tensor ids, offsets, labels;  // ids flat; offsets: where each bag starts in ids
};

// `size` bags of kBagLength tokens: a bag of class c draws 3 of every 4 tokens from
// [c * kVocab / kClasses, (c + 1) * kVocab / kClasses) and the rest from the whole vocabulary.
inline Batch make_batch(int64_t size, at::Generator& gen) {
  const int64_t len = kBagLength, span = kVocab / kClasses;
  at::Tensor labels = at::randint(kClasses, {size}, gen, at::kLong);
  at::Tensor ids = at::randint(kVocab, {size, len}, gen, at::kLong);
  at::Tensor own = labels.unsqueeze(1) * span + at::randint(span, {size, len}, gen, at::kLong);
  at::Tensor pick = at::rand({size, len}, gen) < 0.75;
  ids = at::where(pick, own, ids);
  return {ids.reshape({-1}), at::arange(0, size * len, len, at::kLong), labels};
}

}  // namespace tdist::demo::bags
