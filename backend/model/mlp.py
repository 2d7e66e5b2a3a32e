"""Feed-forward blocks: SwiGLU (Qwen3.5) and Qwen3-Next's mixture of SwiGLU experts; squared
ReLU and the mixture of squared-ReLU experts (Nemotron-H)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: down(relu(up(x))^2), no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


def expert_groups(index: torch.Tensor, num_experts: int):
    """(expert, token rows, top-k slots) for every expert some token chose, from the chosen
    experts index [N, top_k]: one sort of the choices, not one scan per expert."""
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    token, slot = order // index.shape[1], order % index.shape[1]
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            yield e, token[start:start + count], slot[start:start + count]
            start += count


def combine_experts(run, num_experts: int, out_features: int, h: torch.Tensor,
                    weights: torch.Tensor, index: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{index[:, j]}(h) (h [N, D]; weights, index [N, top_k]),
    each expert run once over the tokens routed to it (`run(e, rows)` -> [rows, out]),
    accumulated in `dtype`."""
    out = torch.zeros(h.shape[0], out_features, dtype=dtype, device=h.device)
    for e, token, slot in expert_groups(index, num_experts):
        y = run(e, h.index_select(0, token)) * weights[token, slot, None]
        out.index_add_(0, token, y.to(dtype))
    return out


def run_experts(experts: nn.ModuleList, h: torch.Tensor, weights: torch.Tensor,
                index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine_experts` over a module list."""
    return combine_experts(lambda e, rows: experts[e](rows), len(experts),
                           experts[0].down_proj.out_features, h, weights, index, dtype)


class SparseMoE(nn.Module):
    """Qwen3-Next's sparse MLP: a softmax router choosing `top_k` SwiGLU experts (weights
    renormalised to sum 1 with `norm_topk_prob`), plus a shared SwiGLU expert scaled by a
    sigmoid gate. Names as the checkpoints': `gate.weight`, `experts.<i>.{gate,up,down}_proj`,
    `shared_expert.*`, `shared_expert_gate.weight`."""

    def __init__(self, hidden_size: int, moe: dict) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe["top_k"], moe["norm_topk_prob"]
        self.gate = Linear(hidden_size, moe["num_experts"], bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden_size, moe["intermediate_size"])
                                     for _ in range(moe["num_experts"]))
        self.shared_expert = SwiGLU(hidden_size, moe["shared_intermediate_size"])
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    activation = "swiglu"

    def forward(self, x: torch.Tensor, experts=None) -> torch.Tensor:
        """experts: a function (h, weights, index) -> the routed sum (`plugins.moe_experts`
        over `stacked_weights()`, in the packed graphs); default the loop over the modules."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        weights, index = logits.softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)
        routed = (run_experts(self.experts, flat, weights, index, x.dtype) if experts is None
                  else experts(flat, weights, index).to(x.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).view(shape)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_in [E, 2 I, D]: each expert's gate then up rows, w_down [E, D, I])."""
        return (torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight])
                             for e in self.experts]).detach(),
                torch.stack([e.down_proj.weight for e in self.experts]).detach())


class MoERouter(nn.Module):
    """Nemotron-H's router (DeepSeek-V3 style, as transformers computes it): sigmoid scores
    over the experts (fp32), a bias that only steers the choice, the `topk_group` groups with
    the best two-expert sums, the top-k experts among them; weights are the chosen scores,
    normalised to sum 1 (`norm_topk_prob`) and scaled."""

    def __init__(self, hidden_size: int, moe: dict) -> None:
        super().__init__()
        E = moe["num_experts"]
        self.top_k, self.n_group, self.topk_group = moe["top_k"], moe["n_group"], moe["topk_group"]
        self.norm_topk_prob, self.scale = moe["norm_topk_prob"], moe["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.zeros(E, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, top_k] fp32, expert indices [N, top_k])."""
        E = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(
            1, groups.topk(self.topk_group, dim=-1, sorted=False)[1], 1.0)
        keep = keep.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        index = choice.masked_fill(keep == 0, float("-inf")).topk(
            self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, index


class NemotronMoE(nn.Module):
    """Nemotron-H's mixture-of-experts layer: routed squared-ReLU experts (without biases,
    through a latent projection where the checkpoint has one) plus a shared expert.

    Parameter names follow the checkpoints: `gate.weight`, `gate.e_score_correction_bias`,
    `experts.<i>.up_proj.weight` / `down_proj.weight`, `shared_experts.*`,
    `fc1_latent_proj` / `fc2_latent_proj`. Each expert runs over the tokens routed to it
    (a Python loop over the experts that got tokens; the packed graphs AOT engines compile
    call `plugins.moe_experts` over `stacked_weights()` instead).
    """

    def __init__(self, hidden_size: int, moe: dict, bias: bool = False) -> None:
        super().__init__()
        latent = moe["latent_size"]
        width = latent or hidden_size
        self.gate = MoERouter(hidden_size, moe)
        self.experts = nn.ModuleList(ReluSquaredMLP(width, moe["intermediate_size"])
                                     for _ in range(moe["num_experts"]))
        self.shared_experts = ReluSquaredMLP(hidden_size, moe["shared_intermediate_size"], bias)
        self.fc1_latent_proj = Linear(hidden_size, latent, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, hidden_size, bias=bias) if latent else None

    activation = "relu2"

    def forward(self, x: torch.Tensor, experts=None) -> torch.Tensor:
        """experts: as `SparseMoE.forward`'s."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = self.gate(flat)
        h = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = (run_experts(self.experts, h, weights, index, torch.float32) if experts is None
                  else experts(h, weights, index)).to(x.dtype)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed.view(shape) + self.shared_experts(x)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_in [E, I, D]: each expert's up rows, w_down [E, D, I])."""
        return (torch.stack([e.up_proj.weight for e in self.experts]).detach(),
                torch.stack([e.down_proj.weight for e in self.experts]).detach())
