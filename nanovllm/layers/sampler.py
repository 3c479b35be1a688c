"""Turns the last position's logits into next tokens: argmax for greedy rows (temperature 0),
a temperature-scaled softmax sample for the others, in one batched pass on the device."""
import torch
from torch import nn


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        # logits: [batch, vocab]; temperatures: [batch] float32, 0 = greedy
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        # Gumbel-style draw without a host sync: argmax(p / E) with E ~ Exp(1) samples from p.
        sampled = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
