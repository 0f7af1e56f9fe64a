// `kvsift demo`: every policy over one synthetic chain-of-thought decode at one budget, as a table
// of memory, compression cost and recall of FullKV's most attended tokens. The first command a
// newcomer runs: seconds on one core, no model, no GPU. docs/demo.md explains how to read it.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "demo_generator.hpp"
#include "demo_policy.hpp"
#include "demo_quantizer.hpp"
#include "demo_runner.hpp"
#include "demo_sentences.hpp"
#include "demo_table.hpp"
#include "demo_thinkv.hpp"
#include "device_flag.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "demo_cuda.hpp"
#endif
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/registry.hpp"

namespace kvsift::tool {
namespace {

constexpr const char* kDefaultTokenFile = KVSIFT_DATA_DIR "/math500_r1qwen_tokens.tsv";

std::string registry_list() {
  std::string s;
  for (const MethodInfo& m : registered_methods())
    s += "                    " + std::string(m.name) + ": " + std::string(m.summary) + "\n";
  return s;
}

void print_help() {
  std::cout <<
      R"(usage: kvsift demo [--flag value ...]

Runs every policy over one synthetic, model-free chain-of-thought decode at one budget and prints
resident KV memory, compressions, time per compression and recall of FullKV's top-10 attended tokens.

flags:
  --budget N        tokens kept per (sequence, KV head) after a compression (default 256)
  --length N        decode length in tokens (default 2048)
  --batch N         sequences decoded together (default 2)
  --seed N          seed of the synthetic decode (default 1)
  --layers N        layers, each with its own cache and its own compressions (default 4)
  --dtype T         KV storage dtype: f16, bf16 or f32 (default f16)
  --policies a,b,c  a subset of the registered methods, in this order (default: all of them))
  --window N        observation window W (default 8)
  --buffer N        decode steps between compressions once the budget is reached (default 128)
  --tokens SRC      where sentences end: 'auto' (the MATH-500 token streams when the data file is
                    there, else synthetic lengths), 'synthetic', or a token file path (default auto)
  --thinkv-refill R ThinKV's refill of partly evicted groups: run (default, docs/algorithms.md
                    §3.4) or regroup (the experiment of docs/thinkv.md §6), or regroup:F to
                    re-quantize a group only with at least F (1..15) free slots (regroup = regroup:8)
  --thinkv-block N  ThinKV's slots per block, a multiple of 16 in [16, 256] (default 32)
  --device D        cpu (default) or cuda: every method's select() runs on device copies of the
                    caches (R-KV and SkipKV on CUDA kernels, the others staged to the host by the
                    library); ThinKV stays on the CPU. Needs the CUDA backend and a CUDA device
  --help            this text

methods (the registry):
)" << registry_list();
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    KVSIFT_CHECK(!item.empty(), "flag --policies has an empty name in '", list, "'");
    out.push_back(item);
  }
  KVSIFT_CHECK(!out.empty(), "flag --policies names no policy");
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::vector<std::string> demo_policy_names() { return policy_names(); }

// Checked up front so a bad name fails before any work, with the known names listed.
std::vector<std::string> chosen_policies(const Args& args) {
  const std::vector<std::string> known = demo_policy_names();
  if (!args.has("policies")) return known;
  std::vector<std::string> chosen = split_commas(args.str("policies", ""));
  std::set<std::string> seen;
  for (const auto& name : chosen) {
    bool ok = false;
    for (const auto& k : known) ok = ok || k == name;
    KVSIFT_CHECK(ok, "unknown policy '", name, "' (known: ", joined(known), ")");
    KVSIFT_CHECK(seen.insert(name).second, "policy '", name, "' is listed twice in --policies");
  }
  return chosen;
}

// The one place a method name becomes a demo policy. Planning methods come from the registry with
// the demo's shared knobs (each taking the keys its config has) and are driven like an engine
// drives them (RegistryPolicy); with --device cuda their select() runs on device views. A
// cache-owning method (ThinKV) gets the demo's ThinKV adapter, which calibrates θ1 / θ2 on the
// run (demo_thinkv.hpp); its budget is the demo's (its k, tokens per layer and KV head). The
// quantizers (KIVI, PM-KVQ) get demo_quantizer.hpp's adapter (their settings are described there).
std::unique_ptr<demo::DemoPolicy> make_demo_policy(const std::string& name,
                                                   const std::string& shared_config, int budget,
                                                   std::int64_t length, const std::string& device,
                                                   const std::string& thinkv_refill,
                                                   int thinkv_block) {
  if (method_info(name).family == "quantizer")
    return std::make_unique<demo::QuantizerDemoPolicy>(name, length);
  if (method_info(name).owns_cache) {
    KVSIFT_CHECK(name == "thinkv", "kvsift demo: no demo adapter for the cache-owning method '",
                 name, "'");
    demo::ThinKVDemoOptions o;
    o.budget = budget;
    o.length = length;
    demo::parse_thinkv_refill(thinkv_refill, o);
    o.block_size = thinkv_block;
    return std::make_unique<demo::ThinKVDemoPolicy>(o);
  }
  auto policy =
      std::make_unique<demo::RegistryPolicy>(make_policy(name, filter_config(name, shared_config)));
#if defined(KVSIFT_WITH_CUDA)
  if (device == "cuda") policy->select_plan = demo::select_on_device;
#endif
  (void)device;
  return policy;
}

int positive_flag(const Args& args, const std::string& key, long fallback, long max) {
  return static_cast<int>(args.integer<long>(key, fallback, 1, max));
}

struct SentenceSource {
  std::vector<demo::SentencePlan> plans;  // [batch]
  std::string description;                // for the banner
};

SentenceSource sentence_source(const std::string& tokens, std::int64_t length, int batch,
                               std::uint64_t seed) {
  SentenceSource src;
  std::string path = tokens;
  if (tokens == "auto") path = std::ifstream(kDefaultTokenFile).good() ? kDefaultTokenFile : "";
  if (tokens == "synthetic" || path.empty()) {
    for (int b = 0; b < batch; ++b) {
      src.plans.push_back(demo::synthetic_sentence_plan(length, seed * 1000003ull + b));
    }
    src.description = std::string("Sentence boundaries are synthetic (lengths 6-53 tokens") +
                      (tokens == "auto" ? "; the MATH-500 token file was not found)" : ")");
    return src;
  }
  const auto problems = demo::load_token_streams(path);
  for (int b = 0; b < batch; ++b) {
    src.plans.push_back(
        demo::sentence_plan_from_tokens(demo::token_stream_for_sequence(problems, length, seed, b),
                                        demo::r1qwen_sentence_delimiters()));
  }
  src.description =
      "Sentence boundaries are real: each sequence follows consecutive MATH-500 prompts and "
      "reference solutions (R1-Distill-Qwen token ids), and a sentence ends at each real "
      "delimiter (ids 198, 624, 340, 271, 382, 692, 1939), which SkipKV's sentence tracker also "
      "reads";
  return src;
}

void print_banner(const demo::DemoConfig& cfg, const demo::SyntheticDecode& decode,
                  const SentenceSource& src) {
  const demo::GeneratorConfig& g = cfg.generator;
  std::int64_t sentences = 0, repeats = 0, lookbacks = 0;
  for (int b = 0; b < g.batch; ++b) {
    const auto n = decode.plan(b).sentences();
    sentences += n;
    for (std::int64_t s = 0; s < n; ++s) {
      repeats += decode.repeat_of(b, s) >= 0;
      lookbacks += decode.lookback_target(b, s) >= 0;
    }
  }
  const double mean_len =
      static_cast<double>(decode.length()) * g.batch / static_cast<double>(sentences);
  std::ostringstream os;
  os << "kvsift demo: a SYNTHETIC decode, not a model. " << g.batch << " sequence"
     << (g.batch > 1 ? "s" : "") << " x " << decode.length() << " generated tokens, " << g.layers
     << " layers, " << g.q_heads << " query / " << g.kv_heads << " KV heads (GQA), head_dim "
     << g.head_dim << ", " << dtype_name(cfg.dtype) << " KV storage, no RoPE (keys are "
     << "position-free). " << src.description
     << "; keys, values, queries and the hidden states SkipKV embeds sentences with are synthetic: "
     << sentences << " sentences (mean " << demo::format_fixed(mean_len, 1)
     << " tokens), each with a topic vector its tokens' keys share, plus token noise; " << repeats
     << " of them are planted near-repeats of an earlier sentence (near-identical keys and mean "
     << "hidden state). Queries look back: in " << lookbacks
     << " sentences they mix the current topic with one earlier sentence's topic, "
     << "so attention lands on old content a policy may have evicted. Every policy runs at budget "
     << cfg.budget << " (window " << cfg.window << ", buffer " << cfg.buffer << ").";
  std::cout << demo::wrap_text(os.str(), 100) << '\n';
}

void print_legend(const demo::DemoConfig& cfg, bool with_skipkv, bool with_thinkv,
                  bool with_quantizers) {
  const std::string k = std::to_string(cfg.recall_k);
  std::vector<std::string> lines = {
      "resident KV: K+V bytes held after the last step, all layers (% FullKV: as a share of "
      "FullKV's); peak KV: the most held at any step.",
      "ms/compression: select() + compact() of all " + std::to_string(cfg.generator.layers) +
          " layers at one trigger (wall clock, this machine).",
      "recall@" + k + ": share of FullKV's top-" + k +
          " attended tokens still resident, over the " + std::to_string(cfg.recall_steps) +
          " queries after each compression ('-': never compressed, nothing was lost).",
      "evicting layer-steps: share of (sequence, layer, decode step) triples in which a "
      "compression evicted something.",
      "evicted as whole sentences / fragments: shares of evicted tokens whose whole (closed) "
      "sentence left in one compression, and of those that left as fragments (part of the "
      "sentence stays, had already left, or it was still open)."};
  if (with_skipkv) {
    lines.push_back(
        "skipkv: R-KV's scores minus lambda_i over sentences marked redundant (PSS > 0.95 between "
        "sentence-mean hidden states, checked at each trigger); its tracker reads each step's real "
        "token id and the synthetic hidden state. redundant sentences: sentences marked at the end "
        "(all sequences) of those closed. alpha (N_o): steering strength alpha0 + gamma * N_o per "
        "sequence as of the last trigger, N_o = sentences with 'Alternatively' / 'Wait' / 'again' "
        "ids (reported only: no model, no steering vector).");
  }
  if (with_thinkv) {
    lines.push_back(
        "thinkv: its own paged tables, quantized by thought type (R4 E4 T2: NVFP4 / NVFP4 / "
        "ternary), budget k = " +
        std::to_string(cfg.budget) +
        " tokens per (layer, KV head), tau = 128. Its resident KV counts codes + scales + "
        "metadata + staging, against FullKV in " +
        std::string(dtype_name(cfg.dtype)) +
        " (a block goes back to the pool once every slot of it is evicted; slots held/head: the "
        "slots of the blocks it holds per layer and KV head, live or not). It evicts inside "
        "end_step(): "
        "compressions = steps in which TBE evicted in some sequence, ms = that end_step() time. "
        "theta1/theta2: this decode has no real thought structure, so they are the 1/3 and 2/3 "
        "quantiles of the attention sparsity of every layer over the first 128 steps (held at "
        "full precision, then replayed into ThinKV); L* = all layers; later sparsities are "
        "taken over ThinKV's resident tokens on the unquantized keys. key rel. err: mean "
        "|k_dequantized - k| / |k| over the tokens held in blocks at the end (--thinkv-refill "
        "picks the refill rule, docs/thinkv.md section 6). attn rel. err: the last step's "
        "queries attending over ThinKV's resident tokens as stored, against exact attention "
        "over the same tokens' K/V: mean |o_stored - o| / |o| over layers, sequences and query "
        "heads. Whole-sentence evictions "
        "are not tracked for it.");
  }
  if (with_quantizers) {
    lines.push_back(
        "kivi, pmkvq: quantizers that own their caches and evict nothing; resident KV counts "
        "codes + scales + zero points + full-precision buffers. compressions = quantization "
        "events (kivi: steps in which the 128 full-precision keys were flushed into 2-bit groups; "
        "pmkvq: steps in which its 128-token 16-bit window was flushed into the body or the "
        "body's width halved), ms = that end_step() time. Their recall@" +
        k + " is the share of FullKV's top-" + k + " found among the top-" + k +
        " by their dequantized keys, over the queries after each event. kivi: 2-bit keys per "
        "channel and values per token, groups of 32, a 128-token fp16 residual. pmkvq: its byte "
        "budget per layer and sequence is a quarter of an fp16 cache of the whole decode (at least "
        "what fits it at 2 bits without evicting), so its body narrows 16 > 8 > 4 > 2 bits as "
        "the decode grows.");
  }
  lines.push_back("docs/demo.md explains the generator and the metrics.");
  std::cout << '\n';
  for (const auto& line : lines) std::cout << demo::wrap_text(line, 100);
}

int run_demo_command(const std::vector<std::string>& argv) {
  const Args args(argv,
                  {"budget", "length", "batch", "seed", "layers", "dtype", "policies", "window",
                   "buffer", "tokens", "device", "thinkv-refill", "thinkv-block"},
                  {"help"});
  if (args.has("help")) {
    print_help();
    return 0;
  }
  demo::DemoConfig cfg;
  cfg.budget = positive_flag(args, "budget", 256, 1 << 24);
  cfg.window = positive_flag(args, "window", 8, 1 << 24);
  cfg.buffer = positive_flag(args, "buffer", 128, 1 << 24);
  const std::int64_t length = positive_flag(args, "length", 2048, 1 << 22);
  cfg.generator.batch = positive_flag(args, "batch", 2, 4096);
  cfg.generator.layers = positive_flag(args, "layers", 4, 1024);
  const long seed = args.integer<long>("seed", 1, 0);
  cfg.generator.seed = static_cast<std::uint64_t>(seed);
  cfg.dtype = parse_dtype(args.str("dtype", "f16"));
  cfg.validate();
  const std::string device = device_setting(args);
#if defined(KVSIFT_WITH_CUDA)
  if (device == "cuda") tool::require_cuda_device();
#endif
  // The FullKV reference keeps every key in fp32; refuse runs that would not fit comfortably.
  const double reference_gib = static_cast<double>(length) * cfg.generator.batch *
                               cfg.generator.layers * cfg.generator.kv_heads *
                               cfg.generator.head_dim * 4.0 / (1 << 30);
  KVSIFT_CHECK(reference_gib <= 4.0, "--length ", length, " x --batch ", cfg.generator.batch,
               " x --layers ", cfg.generator.layers, " needs ",
               demo::format_fixed(reference_gib, 1), " GiB for the FullKV reference (limit 4 GiB)");

  const std::vector<std::string> names = chosen_policies(args);
  // The shared knobs; SkipKV embeds the generator's hidden stand-ins (width head_dim).
  const std::string shared = demo::shared_config_json(cfg);
  std::vector<std::unique_ptr<demo::DemoPolicy>> policies;
  for (const auto& name : names)
    policies.push_back(make_demo_policy(name, shared, cfg.budget, length, device,
                                        args.str("thinkv-refill", "run"),
                                        positive_flag(args, "thinkv-block", 32, 256)));

  SentenceSource src =
      sentence_source(args.str("tokens", "auto"), length, cfg.generator.batch, cfg.generator.seed);
  demo::SyntheticDecode decode(cfg.generator, std::move(src.plans));
  print_banner(cfg, decode, src);
  if (device == "cuda") {
    std::cout << demo::wrap_text(
        "--device cuda: each compression uploads the layer's cache and window queries and runs "
        "the method's select() on the device views (R-KV and SkipKV on CUDA kernels, the others "
        "staged back to the host by the library); the plan compacts the demo's cache, and "
        "ms/compression includes the transfers. ThinKV runs on the CPU.",
        100);
  }
  const demo::DemoResult result = demo::run_demo(cfg, decode, policies);
  demo::demo_table(result, cfg.recall_k).print(std::cout);
  const auto chosen = [&](const char* n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  print_legend(cfg, chosen("skipkv"), chosen("thinkv"), chosen("kivi") || chosen("pmkvq"));
  return 0;
}

const RegisterCommand reg{{"demo",
                           "every policy on a synthetic reasoning decode: memory, speed, recall",
                           &run_demo_command}};

}  // namespace
}  // namespace kvsift::tool
