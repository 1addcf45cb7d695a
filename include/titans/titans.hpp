#pragma once
// titans/titans.hpp: the umbrella header, the one way in.
//
// Neural long-term memory of "Titans: Learning to Memorize at Test Time" (Behrouz, Zhong,
// Mirrokni, 2025). See README.md and docs/ for the design and the math.

#include "config.hpp"
#include "error.hpp"
#include "fwd.hpp"
#include "threads.hpp"
#include "activation.hpp"
#include "types.hpp"

#include "memory/chunk_coefficients.hpp"
#include "memory/chunk_coefficients_backward.hpp"
#include "memory/config.hpp"
#include "memory/diagnostics.hpp"
#include "memory/mlp.hpp"
#include "memory/neural_memory.hpp"
#include "memory/params.hpp"
#include "memory/state_gradient.hpp"

#include "attention/attention.hpp"
#include "attention/attention_row.hpp"
#include "attention/kernel_backward.hpp"
#include "attention/rope.hpp"
#include "attention/state_gradient.hpp"

#include "layers/feed_forward.hpp"
#include "layers/persistent_memory.hpp"
#include "layers/rms_norm.hpp"

#include "backend/backend.hpp"
#include "backend/cpu/cpu.hpp"

#include "models/block.hpp"
#include "models/model.hpp"
#include "models/model_gradients.hpp"
#include "models/state_gradient.hpp"
#include "train/adamw.hpp"
#include "train/gradients.hpp"
#include "train/loss.hpp"
#include "train/model_adamw.hpp"
#include "train/schedule.hpp"
#include "train/trainer.hpp"

#include "text/batches.hpp"
#include "text/byte_tokenizer.hpp"
#include "text/corpus.hpp"
#include "text/editions.hpp"
#include "text/generation.hpp"
#include "text/sampling.hpp"
