// Everything an engine needs from kvsift's CPU side, in one include. The layers, top to bottom:
//   core/     views of the engine's cache, KeepPlan, compact(), SegmentTable, safetensors, errors
//   policy/   what to keep: baselines (FullKV, StreamingLLM, H2O, SnapKV, R-KV), SkipKV and ThinKV
//             pieces, chosen at run time through make_policy()
//   quant/    NVFP4, FP8 and ternary codecs (host/device functions)
//   paged/    the Continuous Thinking block table and its paged attention
//   backend/  cpu/ reference math; cuda/ kernels (include backend/cuda/*.hpp, link kvsift::cuda)
#pragma once

#include "kvsift/version.hpp"

#include "kvsift/core/compact.hpp"
#include "kvsift/core/device.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/paged_kv_view.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/core/tensor_view.hpp"

#include "kvsift/policy/full_kv.hpp"
#include "kvsift/policy/h2o.hpp"
#include "kvsift/policy/policy.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/rkv.hpp"
#include "kvsift/policy/snapkv.hpp"
#include "kvsift/policy/streaming_llm.hpp"

#include "kvsift/policy/batch_grouper.hpp"
#include "kvsift/policy/sentence_scorer.hpp"
#include "kvsift/policy/skipkv.hpp"
#include "kvsift/policy/sentence_tracker.hpp"
#include "kvsift/policy/steering.hpp"

#include "kvsift/policy/attention_sparsity.hpp"
#include "kvsift/policy/hybrid_quantizer.hpp"
#include "kvsift/policy/kmeans_select.hpp"
#include "kvsift/policy/segment_evictor.hpp"
#include "kvsift/policy/sparsity_calibration.hpp"
#include "kvsift/policy/thought_classifier.hpp"
#include "kvsift/policy/thinkv.hpp"
#include "kvsift/policy/thought_type.hpp"

#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/thought_block_table.hpp"
