"""SGLang capture backend (not run: sglang cannot be installed here; read against sglang 0.5.23's ``sgl.Engine``
and ``ServerArgs`` and tested on bodies shaped like its own). For a target at Kimi-K2.5's scale prefer
``capture.backend: specforge`` (``data_prep/specforge_import.py``): SpecForge patches SGLang to get the aux *and*
final states out, which the stock engine used here does not do.

Why: an HF forward of a 1T-parameter target needs a tensor-parallel server; SGLang already is one. How:
- aux states: ``enable_return_aux_hidden_states`` (sglang >= 0.5.23) captures on the target alone, no drafter
  loaded: ``speculative_algorithm`` then only names the capture convention (EAGLE3) and
  ``return_aux_hidden_state_layer_ids`` takes the ids a drafter's config carries, handed to the same
  ``set_eagle3_layers_to_capture(ids)`` that serving calls, so capture and serving read the same layers
  (``target_model.aux_layers.sglang_captured_outputs``). ``return_hidden_states`` then returns the
  concatenated states (3H) for every prompt token.
- teacher: SGLang does not return the final hidden state next to the aux states, so only teacher
  'topk' is supported: ``input_top_logprobs`` (position i holds the distribution of token i) plus the
  first output's ``output_top_logprobs`` for the last position. The config refuses teacher 'hidden' here.
- parallelism: ``capture.tensor_parallel_size`` / ``expert_parallel_size`` become the engine's ``tp_size`` /
  ``ep_size`` (sglang ServerArgs).
- no chunked prompt: SGLang stores a prompt's hidden states only when its last prefill chunk commits (sglang 0.5.23,
  ``batch_result_processor``), so a prompt longer than ``chunked_prefill_size`` would come back with its last chunk's
  rows alone. The engine's chunk is therefore at least ``capture.max_length`` (and never below SGLang's own 8192 on an
  80-160 GB GPU), and a sample whose rows do not match its tokens is an error, never a short sample.
Same interface as ``capture.HFCaptureBackend.run``, but it returns the teacher signal directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from common.config import RunConfig
from data_prep.capture_sample import CaptureError

# SGLang's default chunked prefill on an 80-160 GB GPU (H100, H200); a longer capture.max_length raises it
SGLANG_DEFAULT_CHUNK = 8192


class SGLangUnavailable(ValueError):
    """sglang is not installed; the message says what to do."""


class SGLangCaptureBackend:
    def __init__(self, cfg: RunConfig, aux_ids: Sequence[int]):
        try:
            import sglang as sgl
        except ImportError:
            raise SGLangUnavailable("capture.backend 'sglang' needs the sglang package (pip install "
                                    "'eagle3-drafter-pipeline[sglang]' on a GPU host); or use capture.backend: hf"
                                    ) from None
        # teacher "topk" is checked at config load; aux_ids are the resolved ids a drafter's config carries
        self.topk = cfg.capture.topk
        self.engine = sgl.Engine(model_path=cfg.target.name, skip_tokenizer_init=True,
                                 trust_remote_code=cfg.target.trust_remote_code,
                                 tp_size=cfg.capture.tensor_parallel_size, ep_size=cfg.capture.expert_parallel_size,
                                 enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                                 return_aux_hidden_state_layer_ids=list(aux_ids),
                                 chunked_prefill_size=max(cfg.capture.max_length, SGLANG_DEFAULT_CHUNK))

    def run(self, batch: list[list[int]]) -> list[dict[str, Tensor]]:
        outs = self.engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                    return_hidden_states=True, return_logprob=True, logprob_start_len=0,
                                    top_logprobs_num=self.topk)
        return [self._sample(seq, o["meta_info"]) for seq, o in zip(batch, outs, strict=True)]

    def _sample(self, seq: list[int], meta: dict[str, Any]) -> dict[str, Tensor]:
        aux = torch.tensor(meta["hidden_states"][0], dtype=torch.float32)[: len(seq)]
        if aux.shape[0] != len(seq):
            raise CaptureError(f"capture.backend sglang: SGLang returned {aux.shape[0]} hidden-state rows for a "
                               f"{len(seq)}-token sample (a chunked prompt keeps only its last chunk's); lower "
                               "capture.max_length or use capture.backend: specforge")
        # entries are (logprob, token_id, text); position t's next-token distribution is entry t+1
        tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"][:1]
        lps = torch.tensor([[e[0] for e in row] for row in tops], dtype=torch.float32)
        ids = torch.tensor([[e[1] for e in row] for row in tops], dtype=torch.int32)
        return {"aux": aux, "target_argmax": ids[:, 0], "topk_ids": ids, "topk_logprobs": lps}
