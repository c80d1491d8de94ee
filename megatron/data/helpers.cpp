// Index builders for the GPT and blended datasets, compiled by setup.py into
// megatron.data.helpers_cpp (pybind11). Semantics match Megatron-Core's helpers.cpp
// (see ../shared/FORMATS.md section 2b); megatron/data/helpers.py holds a numpy
// fallback that must return identical arrays.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for GPT and blended datasets";
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
