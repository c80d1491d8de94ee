// Index builders for the GPT, BERT and blended datasets, compiled by setup.py into
// megatron.data.helpers_cpp (pybind11). Semantics match Megatron-Core's helpers.cpp
// (see docs/FORMATS.md sections 2b and 2c); megatron/data/helpers.py holds a numpy
// fallback that must return identical arrays.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

// Number of samples the sample index holds (the C++ reference computes the ceil
// variant in single precision; we keep that so both agree on every input).
int64_t count_samples(int64_t total_tokens, int32_t seq_length, bool drop_last, int extra) {
  if (drop_last) {
    return (total_tokens - extra) / seq_length;
  }
  return static_cast<int64_t>(
      std::ceil(static_cast<float>(total_tokens - extra) / static_cast<float>(seq_length)));
}

// Walks document_index, cutting it into samples of seq_length + extra tokens where the
// last token of a sample is the first of the next. Row k = (position in document_index,
// token offset in that document) where sample k starts; row num_samples closes the last.
template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t, py::array::c_style> &sizes_arr,
                                const py::array_t<int32_t, py::array::c_style> &doc_idx_arr,
                                int32_t seq_length, int32_t num_epochs, int64_t tokens_per_epoch,
                                bool drop_last_partial_sequence = true,
                                int add_extra_token_to_sequence = 1) {
  if (seq_length <= 1 || num_epochs <= 0 || tokens_per_epoch <= 1) {
    throw std::invalid_argument("build_sample_idx: need seq_length > 1, num_epochs > 0, "
                                "tokens_per_epoch > 1");
  }
  const int extra = add_extra_token_to_sequence;
  const int64_t num_samples = count_samples(num_epochs * tokens_per_epoch, seq_length,
                                            drop_last_partial_sequence, extra);
  const int32_t *sizes = sizes_arr.data();
  const int32_t *doc_idx = doc_idx_arr.data();
  const int64_t num_docs = doc_idx_arr.shape(0);
  const int64_t num_sizes = sizes_arr.shape(0);

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T *out = result.mutable_data();
  bool bad_doc = false;
  {
    py::gil_scoped_release release;
    int64_t doc = 0;     // position in document_index
    int64_t offset = 0;  // token offset inside that document
    out[0] = 0;
    out[1] = 0;
    for (int64_t row = 1; row <= num_samples && !bad_doc; ++row) {
      int64_t remaining = static_cast<int64_t>(seq_length) + extra;
      while (remaining != 0) {
        const int64_t d = doc_idx[doc];
        if (d < 0 || d >= num_sizes) { bad_doc = true; break; }
        const int64_t left_in_doc = static_cast<int64_t>(sizes[d]) - offset;
        remaining -= left_in_doc;
        if (remaining <= 0) {
          // The document covers the rest: the next sample starts on this sample's last token.
          offset += remaining + left_in_doc - extra;
          remaining = 0;
        } else if (doc == num_docs - 1) {
          // Out of documents (only for the partial last sample when not dropping it).
          offset = static_cast<int64_t>(sizes[d]) - extra;
          break;
        } else {
          ++doc;
          offset = 0;
        }
      }
      out[2 * row] = static_cast<T>(doc);
      out[2 * row + 1] = static_cast<T>(offset);
    }
  }
  if (bad_doc) {
    throw std::out_of_range("build_sample_idx: document_index holds an id outside sizes");
  }
  return result;
}

// Greedy blend: sample s goes to the dataset whose count lags its weight the most,
// error_i = w_i * max(s, 1) - count_i; ties go to the lowest index.
void build_blending_indices(py::array_t<int16_t, py::array::c_style> &dataset_index,
                            py::array_t<int64_t, py::array::c_style> &dataset_sample_index,
                            const py::array_t<double, py::array::c_style | py::array::forcecast> &weights,
                            int32_t num_datasets, int64_t size, bool verbose) {
  (void)verbose;
  if (dataset_index.shape(0) < size || dataset_sample_index.shape(0) < size ||
      weights.shape(0) < num_datasets || num_datasets <= 0) {
    throw std::invalid_argument("build_blending_indices: arrays shorter than size/num_datasets");
  }
  int16_t *ds_index = dataset_index.mutable_data();
  int64_t *ds_sample = dataset_sample_index.mutable_data();
  const double *w = weights.data();
  py::gil_scoped_release release;
  std::vector<int64_t> counts(num_datasets, 0);
  for (int64_t s = 0; s < size; ++s) {
    const double x = std::max(static_cast<double>(s), 1.0);
    int32_t best = 0;
    double best_error = w[0] * x - static_cast<double>(counts[0]);
    for (int32_t i = 1; i < num_datasets; ++i) {
      const double error = w[i] * x - static_cast<double>(counts[i]);
      if (error > best_error) {
        best_error = error;
        best = i;
      }
    }
    ds_index[s] = static_cast<int16_t>(best);
    ds_sample[s] = counts[best];
    ++counts[best];
  }
}

// Like build_blending_indices with weights sizes_i / sum(sizes), but each dataset drops
// out once it has given exactly sizes_i samples; runs until all are exhausted.
void build_exhaustive_blending_indices(py::array_t<int16_t, py::array::c_style> &dataset_index,
                                       py::array_t<int64_t, py::array::c_style> &dataset_sample_index,
                                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &sizes_arr,
                                       int32_t num_datasets) {
  const int64_t *sizes = sizes_arr.data();
  int64_t total = 0;
  for (int32_t i = 0; i < num_datasets; ++i) total += sizes[i];
  if (dataset_index.shape(0) < total || dataset_sample_index.shape(0) < total) {
    throw std::invalid_argument("build_exhaustive_blending_indices: arrays shorter than sum(sizes)");
  }
  int16_t *ds_index = dataset_index.mutable_data();
  int64_t *ds_sample = dataset_sample_index.mutable_data();
  py::gil_scoped_release release;
  std::vector<double> w(num_datasets);
  std::vector<int64_t> counts(num_datasets, 0);
  std::vector<bool> live(num_datasets);
  int32_t num_live = 0;
  for (int32_t i = 0; i < num_datasets; ++i) {
    w[i] = static_cast<double>(sizes[i]) / static_cast<double>(total);
    live[i] = sizes[i] > 0;
    num_live += live[i] ? 1 : 0;
  }
  for (int64_t s = 0; num_live > 0; ++s) {
    const double x = std::max(static_cast<double>(s), 1.0);
    int32_t best = -1;
    double best_error = std::numeric_limits<double>::lowest();
    for (int32_t i = 0; i < num_datasets; ++i) {
      if (!live[i]) continue;
      const double error = w[i] * x - static_cast<double>(counts[i]);
      if (best < 0 || error > best_error) {
        best_error = error;
        best = i;
      }
    }
    ds_index[s] = static_cast<int16_t>(best);
    ds_sample[s] = counts[best];
    if (++counts[best] == sizes[best]) {
      live[best] = false;
      --num_live;
    }
  }
}

// ---------------------------------------------------------------------------------------
// BERT samples mapping (Megatron-Core's build_mapping)
// ---------------------------------------------------------------------------------------

// A document of several sentences holding one longer than this is skipped whole.
constexpr int64_t kLongSentenceLen = 512;

// The target length of the next sample: the maximum, or with probability ~1/ratio a
// length in [2, max_length]. One draw per call when ratio > 0 (the draws decide which
// samples exist, so their order is part of the format).
int32_t next_target_length(int32_t short_seq_ratio, int32_t max_length, std::mt19937 &gen) {
  if (short_seq_ratio == 0) return max_length;
  const uint64_t r = gen();
  if (r % static_cast<uint64_t>(short_seq_ratio) == 0) {
    return static_cast<int32_t>(2 + r % static_cast<uint64_t>(max_length - 1));
  }
  return max_length;
}

// Whether a document of more than one sentence holds a sentence over kLongSentenceLen.
bool has_long_sentence(const int32_t *sizes, int64_t first, int64_t last) {
  if (last - first <= 1) return false;
  for (int64_t s = first; s < last; ++s) {
    if (sizes[s] > kLongSentenceLen) return true;
  }
  return false;
}

// Walks every document of the split once per epoch (the generator carries across epochs),
// packing consecutive sentences into samples (first sentence, end sentence exclusive,
// target length). With out == nullptr only counts. Whole epochs: it stops at the start of
// the first epoch that finds max_num_samples reached (or when an epoch yields nothing).
template <typename T>
uint64_t pack_sentences(const int64_t *docs, int64_t num_docs, const int32_t *sizes,
                        int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length,
                        int32_t short_seq_ratio, uint32_t seed, int32_t min_num_sent, T *out) {
  std::mt19937 gen(seed);
  uint64_t count = 0;
  for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
    if (count >= max_num_samples) break;
    if (epoch > 0 && count == 0) break;  // nothing to pack: more epochs would loop for nothing
    for (int64_t doc = 0; doc < num_docs; ++doc) {
      const int64_t first = docs[doc];
      const int64_t last = docs[doc + 1];
      int64_t remaining = last - first;
      if (remaining < min_num_sent || has_long_sentence(sizes, first, last)) continue;
      int64_t start = first;
      int32_t length = 0;
      int32_t num_sent = 0;
      int32_t target = next_target_length(short_seq_ratio, max_seq_length, gen);
      for (int64_t s = first; s < last; ++s) {
        length += sizes[s];
        ++num_sent;
        --remaining;
        // Close the sample at the target length unless only one sentence would be left
        // over (it could not form a sample of its own), and always at the document end.
        const bool full = length >= target && remaining > 1 && num_sent >= min_num_sent;
        if (full || remaining == 0) {
          if (out != nullptr) {
            out[3 * count] = static_cast<T>(start);
            out[3 * count + 1] = static_cast<T>(s + 1);
            out[3 * count + 2] = static_cast<T>(target);
          }
          ++count;
          start = s + 1;
          target = next_target_length(short_seq_ratio, max_seq_length, gen);
          length = 0;
          num_sent = 0;
        }
      }
    }
  }
  return count;
}

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

template <typename T>
py::array build_mapping_of(const Int64Array &docs_arr, const Int32Array &sizes_arr,
                           int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length,
                           double short_seq_prob, int32_t seed, int32_t min_num_sent) {
  const int64_t *docs = docs_arr.data();
  const int64_t num_docs = docs_arr.shape(0) - 1;
  const int32_t *sizes = sizes_arr.data();
  for (int64_t d = 0; d <= num_docs; ++d) {
    if (docs[d] < 0 || docs[d] > sizes_arr.shape(0) || (d > 0 && docs[d] < docs[d - 1])) {
      throw std::out_of_range("build_mapping: document boundaries outside the sentences");
    }
  }
  const int32_t ratio = short_seq_prob > 0
                            ? static_cast<int32_t>(std::round(1.0 / short_seq_prob)) : 0;
  const uint32_t seed32 = static_cast<uint32_t>(seed);
  uint64_t count = 0;
  {
    py::gil_scoped_release release;
    count = pack_sentences<T>(docs, num_docs, sizes, num_epochs, max_num_samples,
                              max_seq_length, ratio, seed32, min_num_sent, nullptr);
  }
  py::array_t<T> result({static_cast<int64_t>(count), static_cast<int64_t>(3)});
  T *out = result.mutable_data();
  {
    py::gil_scoped_release release;
    pack_sentences<T>(docs, num_docs, sizes, num_epochs, max_num_samples, max_seq_length, ratio,
                      seed32, min_num_sent, out);
    // Fisher-Yates over whole rows with a 64-bit generator (over 2^32 samples possible).
    std::mt19937_64 gen64(static_cast<uint64_t>(static_cast<int64_t>(seed) + 1));
    for (int64_t i = static_cast<int64_t>(count) - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(gen64() % static_cast<uint64_t>(i + 1));
      for (int k = 0; k < 3; ++k) std::swap(out[3 * i + k], out[3 * j + k]);
    }
  }
  return result;
}

// uint32 rows unless the dataset has more sentences than uint32 holds.
py::array build_mapping(const Int64Array &docs, const Int32Array &sizes, int32_t num_epochs,
                        uint64_t max_num_samples, int32_t max_seq_length, double short_seq_prob,
                        int32_t seed, bool verbose, int32_t min_num_sent) {
  (void)verbose;
  if (num_epochs <= 0 || max_seq_length <= 1 || short_seq_prob < 0.0 || short_seq_prob > 1.0 ||
      docs.shape(0) < 1) {
    throw std::invalid_argument("build_mapping: need num_epochs > 0, max_seq_length > 1, "
                                "0 <= short_seq_prob <= 1 and document boundaries");
  }
  if (static_cast<uint64_t>(sizes.size()) > std::numeric_limits<uint32_t>::max()) {
    return build_mapping_of<uint64_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length,
                                      short_seq_prob, seed, min_num_sent);
  }
  return build_mapping_of<uint32_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length,
                                    short_seq_prob, seed, min_num_sent);
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for GPT, BERT and blended datasets";
  m.def("build_mapping", &build_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
        py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"),
        py::arg("seed"), py::arg("verbose"), py::arg("min_num_sent"));
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"),
        py::arg("document_index"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
        py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"),
        py::arg("document_index"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
        py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"), py::arg("verbose") = false);
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("sizes"),
        py::arg("num_datasets"));
}
