"""Speculative decoding's runner: propose tokens, verify them in one target forward pass, keep the
longest accepted run plus one more token.

A SpeculativeRunner is a Runner (runner/protocol.py), used by the engine as any other; its
RunnerOutput carries each sequence's accepted proposals and how many were proposed. A step:
1. The swap copies (the target's cache, and the draft's, which mirrors it block for block).
2. Proposals for the sequences the scheduler gave lookahead slots (`num_lookahead_slots`): the
   n-gram proposer (scheduling/ngram_proposer.py), or the draft model decoding one token per pass
   (greedy rows take its argmax; sampled rows draw from its distribution q, kept for step 4).
3. One target forward pass over the step's message, each proposal after its sequence's newest
   token (a varlen step over the cache: the attention backends' prefill-with-prefix path), and,
   with a draft model, the draft's forward pass over the same message: its K/V cover exactly the
   tokens the target's do, so prefix-cache hits, preemption and swaps hold for both caches.
4. Sequences without proposals sample with the Sampler; the others go through the
   RejectionSampler (layers/rejection_sampler.py): accepted proposals, then one more token.
The K/V written for rejected proposals are left in place: the scheduler rolls the sequence back
(its computed count, its lookahead blocks), and the next step overwrites those slots. It changes
no sequence (but a seeded one's generator), as the ModelRunner.
"""
import copy
import logging
import torch

from nanovllm.config import Config
from nanovllm.scheduling.block_manager import NO_COPIES, BlockCopies
from nanovllm.scheduling.ngram_proposer import NgramProposer
from nanovllm.scheduling.scheduler import RECOMPUTE
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.rejection_sampler import RejectionSampler
from nanovllm.layers.sampler import TokenLogprobs
from nanovllm.runner.memory_check import kv_block_bytes, model_bytes, model_on_meta
from nanovllm.runner.model_runner import MemoryReserve, ModelRunner, StepLogits
from nanovllm.runner.protocol import RunnerOutput
from nanovllm.runner.sampling_inputs import prepare_sampling
from nanovllm.runner.step_inputs import StepMessage
from nanovllm.speculative_config import DRAFT_MODEL

logger = logging.getLogger("nanovllm")


def draft_footprint(config: Config) -> MemoryReserve:
    """The draft model's weights and its bytes per KV block (in its cache's dtype: fp8 when
    kv_cache_dtype asks, as the target's), from a build on the meta device (nothing allocated,
    nothing read), so the target can size its cache leaving room for both."""
    model = model_on_meta(config)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return MemoryReserve(model_bytes(model), kv_block_bytes(len(layers), config.kvcache_block_size,
                                                            layers[0].num_kv_heads, layers[0].head_dim,
                                                            config.kv_cache_torch_dtype))


class SpeculativeRunner:

    def __init__(self, config: Config):
        spec = config.speculative
        self.config = config
        self.method = spec.method
        self.draft: ModelRunner | None = None
        self.ngram: NgramProposer | None = None
        if spec.method == DRAFT_MODEL:
            self.target = ModelRunner(config, draft_footprint(config.draft_config))
            draft_config = copy.copy(config.draft_config)  # the target's block count, and its swap blocks below
            draft_config.num_kvcache_blocks, draft_config.preemption_mode = self.target.num_kvcache_blocks, RECOMPUTE
            try:
                self.draft = ModelRunner(draft_config)
            except BaseException:
                self.target.exit()
                raise
            self.draft.num_swap_blocks = self.draft.allocate_swap_space(self.target.num_swap_blocks)
        else:
            self.target = ModelRunner(config)
            self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.num_kvcache_blocks = self.target.num_kvcache_blocks
        self.num_swap_blocks = self.target.num_swap_blocks
        self.attention_backend = self.target.attention_backend
        self.rejection_sampler = RejectionSampler(self.target.platform.draw)
        # The draft's q rows of this step's proposals (per sequence of the step, a [proposed, vocab]
        # tensor, or None), from _propose to _verify; None when no row needs them.
        self._draft_probs: list[torch.Tensor | None] | None = None
        logger.info("speculative decoding: %s, up to %d tokens per step%s", spec.method, spec.num_speculative_tokens,
                    f", draft {spec.model}" if self.draft else
                    f", prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens")

    def exit(self) -> None:
        self.target.exit()
        if self.draft is not None:
            self.draft.exit()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = NO_COPIES,
            swap_in: BlockCopies = NO_COPIES) -> RunnerOutput:
        # 1. Swaps first: the draft's proposal passes below write to blocks a swap-out may read.
        self.target.swap(swap_out, swap_in)
        if self.draft is not None:
            self.draft.swap(swap_out, swap_in)
        if not seqs:
            return RunnerOutput([], [], None, [], [])
        # 2. Proposals.
        proposals = self._propose(seqs)
        proposed = any(proposals)
        # 3. The target's forward pass over them (and the draft's, to keep its cache in step).
        step = StepMessage.of(seqs, is_prefill or proposed, proposals=proposals if proposed else None)
        logits = self.target.forward(step)
        if self.draft is not None:
            self.draft.forward(step)
        # 4. Verification.
        return self._verify(seqs, logits, proposals)

    def _propose(self, seqs: list[Sequence]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        self._draft_probs = None
        active = [i for i, seq in enumerate(seqs) if seq.num_lookahead_slots]
        if not active:
            return proposals
        group = [seqs[i] for i in active]
        found = self.ngram.propose(group) if self.ngram is not None else self._draft_propose(group)
        for i, proposal in zip(active, found):
            proposals[i] = proposal
        if self._draft_probs is not None:  # per sequence of the step, as proposals
            probs: list[torch.Tensor | None] = [None] * len(seqs)
            for i, q in zip(active, self._draft_probs):
                probs[i] = q
            self._draft_probs = probs
        return proposals

    def _draft_propose(self, group: list[Sequence]) -> list[list[int]]:
        """The draft model decodes each sequence's lookahead, one token per pass: pass j feeds the
        token proposed in pass j - 1 (the newest token first) at position len - 1 + j; a sequence
        leaves once it has its num_lookahead_slots tokens. Sampled rows keep q, the distribution
        their token was drawn from (set in self._draft_probs; None for a greedy sequence)."""
        vocab, eos, device = self.config.hf_config.vocab_size, self.config.eos, self.target.device
        proposals: list[list[int]] = [[] for _ in group]
        q_rows: list[list[torch.Tensor]] = [[] for _ in group]
        any_sampled = False
        for j in range(max(seq.num_lookahead_slots for seq in group)):
            live = [r for r, seq in enumerate(group) if seq.num_lookahead_slots > j]
            seqs = [group[r] for r in live]
            lengths = [len(seq) + j for seq in seqs]
            tokens = [proposals[r][-1] if j else seq.last_token for r, seq in zip(live, seqs)]
            step = StepMessage(False, tokens, [n - 1 for n in lengths], lengths, lengths,
                               [seq.block_table for seq in seqs])
            logits = self.draft.forward(step).logits.float()  # [live, vocab]
            t = prepare_sampling(seqs, vocab, eos, device, drafts=[proposals[r] for r in live])
            adjusted = t.adjust(logits)
            chosen = adjusted.argmax(dim=-1)
            if not t.all_greedy:
                any_sampled = True
                q = torch.softmax(t.filter(adjusted), dim=-1)
                chosen = torch.where(t.temperatures > 0, self.target.platform.draw(q, t), chosen)
                for k, r in enumerate(live):
                    if group[r].temperature > 0:  # a greedy row's verification needs no q
                        q_rows[r].append(q[k])
            for r, token in zip(live, chosen.tolist()):
                proposals[r].append(token)
        if any_sampled:
            self._draft_probs = [torch.stack(rows) if rows else None for rows in q_rows]
        return proposals

    def _verify(self, seqs: list[Sequence], step: StepLogits, proposals: list[list[int]]) -> RunnerOutput:
        n = len(seqs)
        token_ids = [-1] * n
        accepted: list[list[int]] = [[] for _ in seqs]
        logprobs: list[TokenLogprobs | None] = [None] * n
        num_proposed = [len(p) for p in proposals]
        if not step.sample_indices:
            return RunnerOutput(token_ids, logprobs, None, accepted, num_proposed, step.prompt_logprobs)
        # The logits hold 1 + proposed rows per sampling sequence, in order.
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for i in step.sample_indices:
            k = num_proposed[i]
            if k:
                spec.append(i)
                spec_rows.extend(range(row, row + k + 1))
            else:
                plain.append(i)
                plain_rows.append(row)
            row += k + 1
        device = step.logits.device
        failed = None
        if plain:
            logits = step.logits if not spec else step.logits[torch.tensor(plain_rows, device=device)]
            out = self.target.sample(seqs, StepLogits(logits, plain))
            failed = out.failed
            for i in plain:
                token_ids[i], logprobs[i] = out.token_ids[i], out.logprobs[i]
        if spec:
            self._verify_proposals(seqs, step.logits[torch.tensor(spec_rows, device=device)], spec, proposals,
                                   token_ids, accepted)
        return RunnerOutput(token_ids, logprobs, failed, accepted, num_proposed, step.prompt_logprobs)

    def _verify_proposals(self, seqs: list[Sequence], logits: torch.Tensor, spec: list[int],
                          proposals: list[list[int]], token_ids: list[int], accepted: list[list[int]]) -> None:
        """The rejection sampler over the rows of the sequences with proposals (`logits`: each
        one's 1 + proposed rows, in order); each one's accepted proposals go into `accepted`,
        the token after them into `token_ids`."""
        rows_of = [[seqs[i]] * (len(proposals[i]) + 1) for i in spec]
        # Row j of a sequence judges proposal j, after proposals 0..j-1 (a grammar's mask follows them).
        drafts = [proposals[i][:j] for i in spec for j in range(len(proposals[i]) + 1)]
        t = prepare_sampling([seq for rows in rows_of for seq in rows], logits.size(-1), self.config.eos,
                             logits.device, drafts=drafts)
        proposed = torch.tensor([tok for i in spec for tok in proposals[i] + [-1]], dtype=torch.int64,
                                device=logits.device)
        draft_probs = None
        if self._draft_probs is not None:
            zeros = torch.zeros(1, logits.size(-1), device=logits.device)
            draft_probs = torch.cat([torch.cat([q if q is not None else zeros.expand(len(proposals[i]), -1), zeros])
                                     for i, q in ((i, self._draft_probs[i]) for i in spec)])
        verdicts = self.rejection_sampler(logits, proposed, draft_probs, t)
        row = 0
        for i in spec:
            k = len(proposals[i])
            num_accepted = 0
            while num_accepted < k and verdicts.accepted[row + num_accepted]:
                num_accepted += 1
            accepted[i], token_ids[i] = proposals[i][:num_accepted], verdicts.tokens[row + num_accepted]
            row += k + 1
