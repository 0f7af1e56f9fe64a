// SteeringController: SkipKV's adaptive steering (docs/algorithms.md §2.5). A fixed vector v, built
// offline SEAL-style as mean(hidden at execution thoughts) - mean(hidden at non-execution
// thoughts), is added to the input of one decoder layer at thought boundaries inside
// <think>…</think>, with a per-sequence strength α = α0 + γ·N_o that grows with the number of
// "check" sentences N_o the sequence has produced (refreshed every SteeringConfig::refresh_steps
// decode steps and at compression triggers, by the host or SkipKV). It
// pushes the model away from reflection/transition loops, which is what makes fewer KV entries
// necessary in the first place.
// Sign convention: the reference code stores -v and uses α0 = -1.25; kvsift stores +v, α0 = 1.25,
// which is the same update.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/config/steering_config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/parse_number.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// ---- SEAL thought labels (for building the vector) ---------------------------------------------

enum class ThoughtKind : std::uint8_t { execution, reflection, transition };

inline const char* thought_kind_name(ThoughtKind k) {
  switch (k) {
    case ThoughtKind::execution:
      return "execution";
    case ThoughtKind::reflection:
      return "reflection";
    case ThoughtKind::transition:
      return "transition";
  }
  return "unknown";
}

// Labels one thought (a "\n\n"-separated chunk of reasoning) as SEAL does (§2.5): reflection if
// it starts with "Wait" or contains one of its self-check phrases, else transition if it starts
// with "Alternatively" or names another way/approach, else execution. Case-sensitive substring
// tests; "starts with" ignores leading whitespace. Reflection is tested first.
inline ThoughtKind label_thought(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  const std::string_view body =
      first == std::string_view::npos ? std::string_view{} : text.substr(first);
  auto starts = [&](std::string_view p) { return body.substr(0, p.size()) == p; };
  auto contains_any = [&](std::initializer_list<std::string_view> phrases) {
    return std::any_of(phrases.begin(), phrases.end(),
                       [&](std::string_view p) { return text.find(p) != std::string_view::npos; });
  };
  if (starts("Wait") || contains_any({"verify", "make sure", "hold on", "think again", "'s correct",
                                      "'s incorrect", "Let me check", "seems right"})) {
    return ThoughtKind::reflection;
  }
  if (starts("Alternatively") || contains_any({"think differently", "another way", "approach",
                                               "method", "solution", "strategy", "technique"})) {
    return ThoughtKind::transition;
  }
  return ThoughtKind::execution;
}

// Splits reasoning text into thoughts at "\n\n" (the boundaries the vector is read at), dropping
// chunks that are empty or whitespace only.
inline std::vector<std::string_view> split_thoughts(std::string_view text) {
  std::vector<std::string_view> out;
  std::size_t from = 0;
  while (from <= text.size()) {
    const std::size_t at = text.find("\n\n", from);
    const std::size_t stop = at == std::string_view::npos ? text.size() : at;
    const std::string_view piece = text.substr(from, stop - from);
    if (piece.find_first_not_of(" \t\r\n") != std::string_view::npos) out.push_back(piece);
    if (at == std::string_view::npos) break;
    from = at + 2;
  }
  return out;
}

// ---- the steering vector ------------------------------------------------------------------------

struct SteeringVector {
  std::vector<float> values;  // [hidden]
  int layer = 20;             // decoder layer whose input it is added to
  std::string model;          // which model it was built for (informational)

  std::int64_t hidden_size() const { return static_cast<std::int64_t>(values.size()); }

  void validate() const {
    KVSIFT_CHECK(!values.empty(), "SteeringVector: no values (hidden size 0)");
    KVSIFT_CHECK(layer >= 0, "SteeringVector: layer (", layer, ") must be >= 0");
    for (std::size_t k = 0; k < values.size(); ++k) {
      KVSIFT_CHECK(std::isfinite(values[k]), "SteeringVector: value[", k, "] = ", values[k],
                   " is not finite");
    }
  }

  // Safetensors: tensor `steering_vector` [hidden] F32; metadata `layer`, `model`.
  void save(const std::string& path) const {
    validate();
    SafetensorsFile f;
    f.put_f32("steering_vector", {hidden_size()}, values.data());
    f.metadata()["layer"] = std::to_string(layer);
    f.metadata()["model"] = model;
    f.metadata()["construction"] = "mean(execution hidden) - mean(non-execution hidden)";
    f.save(path);
  }

  static SteeringVector load(const std::string& path) {
    const SafetensorsFile f = SafetensorsFile::load(path);
    const StTensor& t = f.get("steering_vector");
    KVSIFT_CHECK(t.shape.size() == 1, "SteeringVector::load: '", path,
                 "': steering_vector must be [hidden], got rank ", t.shape.size());
    SteeringVector v;
    v.values = t.to_f32();
    const auto& meta = f.metadata();
    const auto layer = meta.find("layer");
    KVSIFT_CHECK(layer != meta.end(), "SteeringVector::load: '", path, "' has no 'layer' metadata");
    v.layer = parse_integer<int>(layer->second,
                                 "SteeringVector::load: '" + path + "': layer metadata", 0);
    const auto model = meta.find("model");
    if (model != meta.end()) v.model = model->second;
    v.validate();
    return v;
  }
};

// Accumulates labelled hidden states (layer L, at the "\n\n" token before each thought) and
// builds v = mean(execution) - mean(reflection and transition) (SEAL's construction, §2.5).
class SteeringVectorBuilder {
 public:
  explicit SteeringVectorBuilder(std::int64_t hidden_size)
      : hidden_(hidden_size),
        execution_sum_(static_cast<std::size_t>(std::max<std::int64_t>(hidden_size, 0)), 0.0),
        other_sum_(execution_sum_) {
    KVSIFT_CHECK(hidden_size > 0, "SteeringVectorBuilder: hidden_size (", hidden_size,
                 ") must be > 0");
  }

  // `hidden`: [n, hidden_size] on the CPU, f32/f16/bf16, any strides; every row one sample of
  // the thought kind `kind`.
  void add(ThoughtKind kind, const TensorView& hidden) {
    KVSIFT_CHECK(hidden.rank == 2 && hidden.shape[1] == hidden_,
                 "SteeringVectorBuilder::add: hidden is ", hidden.shape_string(),
                 ", expected [samples, ", hidden_, "]");
    KVSIFT_CHECK(hidden.device == Device::cpu,
                 "SteeringVectorBuilder::add: hidden must be on "
                 "the CPU");
    std::vector<double>& sum = kind == ThoughtKind::execution ? execution_sum_ : other_sum_;
    std::int64_t& count = kind == ThoughtKind::execution ? execution_count_ : other_count_;
    KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] {
      for (std::int64_t i = 0; i < hidden.shape[0]; ++i) {
        for (std::int64_t k = 0; k < hidden_; ++k) {
          sum[k] += static_cast<double>(to_float(*hidden.ptr<T>(i, k)));
        }
      }
    });
    count += hidden.shape[0];
  }
  // One f32 sample of `hidden_size` values.
  void add(ThoughtKind kind, const float* sample) {
    add(kind,
        TensorView::contiguous(const_cast<float*>(sample), DType::f32, Device::cpu, {1, hidden_}));
  }

  std::int64_t execution_count() const { return execution_count_; }
  std::int64_t non_execution_count() const { return other_count_; }

  SteeringVector build(int layer, std::string model) const {
    KVSIFT_CHECK(execution_count_ > 0 && other_count_ > 0,
                 "SteeringVectorBuilder::build: need samples of both classes, have ",
                 execution_count_, " execution and ", other_count_, " non-execution");
    SteeringVector v;
    v.layer = layer;
    v.model = std::move(model);
    v.values.resize(static_cast<std::size_t>(hidden_));
    for (std::int64_t k = 0; k < hidden_; ++k) {
      v.values[k] =
          static_cast<float>(execution_sum_[k] / execution_count_ - other_sum_[k] / other_count_);
    }
    v.validate();
    return v;
  }

 private:
  std::int64_t hidden_;
  std::vector<double> execution_sum_;  // [hidden]
  std::vector<double> other_sum_;      // [hidden]
  std::int64_t execution_count_ = 0;
  std::int64_t other_count_ = 0;
};

// ---- applying it at decode time
// ------------------------------------------------------------------

class SteeringController {
 public:
  SteeringController(SteeringConfig config, SteeringVector vector, std::int64_t batch)
      : config_(std::move(config)), vector_(std::move(vector)) {
    config_.validate();
    vector_.validate();
    KVSIFT_CHECK(vector_.layer == config_.layer,
                 "SteeringController: the vector was built for "
                 "layer ",
                 vector_.layer, ", the config steers layer ", config_.layer);
    KVSIFT_CHECK(batch > 0, "SteeringController: batch (", batch, ") must be > 0");
    seqs_.assign(static_cast<std::size_t>(batch), Seq{false, false, config_.alpha0});
    // Sorted once: the gate looks every token up among hundreds of paragraph-break ids.
    boundary_sorted_ = config_.boundary;
    std::sort(boundary_sorted_.begin(), boundary_sorted_.end());
  }

  const SteeringConfig& config() const { return config_; }
  const SteeringVector& vector() const { return vector_; }
  std::int64_t batch() const { return static_cast<std::int64_t>(seqs_.size()); }

  // Every appended token of sequence b (prompt and decode): tracks <think>…</think> and whether
  // the last token is a thought boundary.
  void observe(std::int64_t b, const std::int32_t* tokens, std::int64_t n) {
    Seq& s = seq(b, "observe");
    KVSIFT_CHECK(n >= 0 && (n == 0 || tokens != nullptr),
                 "SteeringController::observe: bad "
                 "tokens (n = ",
                 n, ")");
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t id = tokens[i];
      if (contains(config_.think_start, id)) s.in_think = true;
      if (contains(config_.think_end, id)) s.in_think = false;
      s.at_boundary = std::binary_search(boundary_sorted_.begin(), boundary_sorted_.end(), id);
    }
  }
  void observe(std::int64_t b, const std::vector<std::int32_t>& tokens) {
    observe(b, tokens.data(), static_cast<std::int64_t>(tokens.size()));
  }

  // At a refresh (every config().refresh_steps decode steps, and at compression triggers):
  // α_b = α0 + γ·N_o with N_o the check sentences of b so far (SentenceTracker::check_count()).
  // Between refreshes α_b stays fixed.
  void update_strength(std::int64_t b, std::int64_t check_sentences) {
    Seq& s = seq(b, "update_strength");
    KVSIFT_CHECK(check_sentences >= 0, "SteeringController::update_strength: check_sentences (",
                 check_sentences, ") must be >= 0");
    s.alpha = config_.alpha0 + config_.gamma * static_cast<float>(check_sentences);
  }

  // A new request in slot b: outside <think>, α back to α0.
  void reset(std::int64_t b) { seq(b, "reset") = Seq{false, false, config_.alpha0}; }

  float strength(std::int64_t b) const { return seq(b, "strength").alpha; }
  // Steer b this step: inside <think>…</think> and the last token contains "\n\n".
  bool gated(std::int64_t b) const {
    const Seq& s = seq(b, "gated");
    return s.in_think && s.at_boundary;
  }

  // h[b, seq-1, :] += α_b · v for every gated row b, when `layer` is the steered one (other layers
  // are left alone, so a host may call this at every layer). `hidden` is the input of decoder
  // layer `layer`: [batch, seq, hidden] on the CPU, f32/f16/bf16 (16-bit: converted, added in
  // fp32, rounded back to nearest even), any strides. Returns the number of rows steered.
  std::int64_t apply(int layer, const TensorView& hidden) const {
    KVSIFT_CHECK(hidden.rank == 3,
                 "SteeringController::apply: hidden must be [batch, seq, "
                 "hidden], got ",
                 hidden.shape_string());
    KVSIFT_CHECK(hidden.shape[0] == batch(), "SteeringController::apply: hidden has batch ",
                 hidden.shape[0], ", the controller tracks ", batch(), " sequences");
    KVSIFT_CHECK(hidden.shape[2] == vector_.hidden_size(),
                 "SteeringController::apply: steering "
                 "vector has ",
                 vector_.hidden_size(), " values, hidden size is ", hidden.shape[2]);
    KVSIFT_CHECK(hidden.shape[1] >= 1,
                 "SteeringController::apply: hidden has no positions (seq = ", hidden.shape[1],
                 ")");
    KVSIFT_CHECK(hidden.device == Device::cpu,
                 "SteeringController::apply: hidden must be on the "
                 "CPU");
    if (layer != config_.layer) return 0;
    const std::int64_t last = hidden.shape[1] - 1;
    std::int64_t steered = 0;
    for (std::int64_t b = 0; b < batch(); ++b) {
      if (!gated(b)) continue;
      const float alpha = seqs_[b].alpha;
      KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] {
        for (std::int64_t k = 0; k < hidden.shape[2]; ++k) {
          T* x = hidden.ptr<T>(b, last, k);
          *x = from_float<T>(to_float(*x) + alpha * vector_.values[k]);
        }
      });
      ++steered;
    }
    return steered;
  }

 private:
  struct Seq {
    bool in_think;
    bool at_boundary;
    float alpha;
  };
  static bool contains(const std::vector<std::int32_t>& ids, std::int32_t id) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  }
  Seq& seq(std::int64_t b, const char* fn) {
    KVSIFT_CHECK(b >= 0 && b < batch(), "SteeringController::", fn, ": sequence ", b,
                 " outside [0, ", batch(), ")");
    return seqs_[static_cast<std::size_t>(b)];
  }
  const Seq& seq(std::int64_t b, const char* fn) const {
    return const_cast<SteeringController*>(this)->seq(b, fn);
  }

  SteeringConfig config_;
  SteeringVector vector_;
  std::vector<Seq> seqs_;                      // [batch]
  std::vector<std::int32_t> boundary_sorted_;  // config_.boundary, ascending
};

}  // namespace kvsift
