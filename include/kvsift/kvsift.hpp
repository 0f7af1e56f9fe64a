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

#include "kvsift/policy/baselines/full_kv.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/policy.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/baselines/snapkv.hpp"
#include "kvsift/policy/baselines/streaming_llm.hpp"

#include "kvsift/policy/skipkv/batch_grouper.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"
#include "kvsift/policy/thinkv/sparsity_calibration.hpp"
#include "kvsift/policy/thinkv/thought_classifier.hpp"
#include "kvsift/policy/thinkv/thinkv.hpp"
#include "kvsift/policy/thinkv/thinkv_policy.hpp"
#include "kvsift/policy/cache_owning_policy.hpp"
#include "kvsift/config/thought_type.hpp"

#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/staged_group_quantizer.hpp"
#include "kvsift/paged/thought_block_table.hpp"
