"""VPT's prompt tokens through a timm Swin, as KMnP/vpt@4410440 prompts its Swin.

All line numbers below are of ``src/models/vit_prompt/swin_transformer.py`` there.  A Swin's blocks see an NHWC
grid, which has no room for extra tokens, so between the wrapped modules the tokens travel as a pair
``(grid, prompts)``: the grid as timm's blocks keep it (B, H, W, C) and the prompts (B, n, C) beside it.  timm's
stages run their blocks in an ``nn.Sequential`` (or ``checkpoint_seq``), which passes the pair on unchanged.

* A block (:class:`PromptedSwinBlock`) normalises grid and prompts with its ``norm1``, copies each image's prompts
  into every window of that image, in front of the window's tokens (L398-407), and runs the window attention with
  the relative-position bias and the shifted-window mask zero-padded for the prompt rows and columns (L476-508): a
  prompt attends to every token of its window and every token attends to the prompts.  Each prompt's outputs are
  averaged over the windows (L411-419), then both residual halves act on prompts and grid alike (L438-443).  The
  prompts' projections run once per image, not once per window copy, with the same numbers up to float rounding
  (:func:`prompted_window_attention`): ``qkv`` acts token by token, so every copy gets the same q, k, v, and
  ``proj`` (an ``nn.Linear``, its dropout off) is affine, so averaging the prompt rows before it equals averaging
  its outputs.  The attention stays per window (each window's prompt rows see that window's tokens), except the
  prompts' attention among themselves, the same in every window: where they outnumber a window's tokens it is
  computed once per image and merged into each window's (:func:`_prompts_apart`).
* A block with prompts of its own (the first; every block with ``deep``) puts them in place of the ones that
  arrive (L162-173; deep: src/models/vit_backbones/swin_transformer.py L428-452).
* A PatchMerging (:class:`PromptedPatchMerging`) tiles the prompts four times along the channels, where it
  concatenates four neighbours, and its norm and reduction act on them as on the merged tokens (L303-343).
* The final norm (:class:`PromptedFinalNorm`) sees prompts and grid, and the head's average pool averages both
  (L262-264): the pair becomes one row of n + H*W tokens, prompts first, which timm's ``ClassifierHead`` averages.
  With ``strip`` the last block removes the prompts instead and the norm and pool see the grid alone.

Where timm differs from the reference's Swin backbone the block follows timm (its padding of a grid that windows
do not divide, its dynamic mask): the prompted block is timm's block with prompts added.  One deliberate
difference from the reference: VPT's block expands the prompts window-major (``expand(num_windows, B, ...)``,
L404-406) while the windows are image-major (src/models/vit_backbones/swin_transformer.py L45), and averages them
back the same way (L418-419), so with more than one image and window an image's prompts meet, and average over,
other images' windows; here each image's prompts join and average its own windows only (a batch of one gives the
reference's numbers, tests/references/test_vpt_swin_reference.py).

A mixed batch (:class:`petl.MultiTask`) has no slot for prompts that travel beside the grid: the rows of VPT tasks
with the same prompt count run the plain Swin's modules in a pass of their own (:func:`rows_with_prompts`), each
row with its own task's prompts, since :func:`prompted_block` takes each image's prompts; the wrappers' row hooks
(``RowHook.beside``) give each block's own prompts and the pooling each task's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.models._features import feature_take_indices
from timm.models.swin_transformer import window_partition, window_reverse
from torch import nn

from petl.model import rows
from petl.model.wrappers import PetlModule

# Tokens between prompted modules: the NHWC grid and the prompts (B, n, C) beside it.
Pair = tuple[torch.Tensor, torch.Tensor]


class PromptedSwinBlock(PetlModule):
    """A timm SwinTransformerBlock that runs prompt tokens beside its grid.

    Args:
        base: the timm block.
        prompt: this block's prompts (``num_tokens`` x width), or ``None`` to carry the prompts that arrive.
        strip: return the grid alone (the last block, when the pooling must not see the prompts).
        dropout: dropout on ``prompt``, drawn per image.

    """

    # The prompts travel beside the grid, not in it (petl.model.timm_api takes the grid for the intermediates).
    prompt_place = "beside"

    def __init__(self, base: nn.Module, prompt: torch.Tensor | None, strip: bool, dropout: float) -> None:
        super().__init__(base)
        self.strip = strip
        self.prompt = None if prompt is None else nn.Parameter(prompt)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor | Pair) -> torch.Tensor | Pair:
        grid, prompts = (x, None) if isinstance(x, torch.Tensor) else x
        if self.prompt is not None:
            # Expanded to the batch before the dropout, so each image gets its own mask (L169-170).
            prompts = self.dropout(self.prompt.unsqueeze(0).expand(grid.shape[0], -1, -1).to(grid.dtype))
        if prompts is None:
            raise ValueError("a PromptedSwinBlock without prompts of its own takes (grid, prompts) from the one before")
        grid, prompts = prompted_block(self.base, grid, prompts)
        return grid if self.strip else (grid, prompts)

    def no_weight_decay(self) -> set[str]:
        """Prompt tokens are exempt from weight decay by default (see petl.train.engine.param_groups)."""
        return {"prompt"} if self.prompt is not None else set()


class PromptedPatchMerging(PetlModule):
    """A timm PatchMerging that also merges the prompts: each tiled 4x along the channels, then norm and reduction."""

    def forward(self, x: torch.Tensor | Pair) -> torch.Tensor | Pair:
        if isinstance(x, torch.Tensor):
            return self.base(x)
        grid, prompts = x
        return self.base(grid), merged_prompts(self.base, prompts)


def merged_prompts(merging: nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    """The prompts through timm's PatchMerging ``merging``: tiled 4x along the channels, then its norm and reduction."""
    # L307-308 (prompt_upsampling is None for prepend, L296-301), L339-342.
    return merging.reduction(merging.norm(torch.cat([prompts] * 4, dim=-1)))


class PromptedFinalNorm(PetlModule):
    """The norm after the last stage, over prompts and grid: one row of n + H*W tokens for the head to average."""

    def forward(self, x: torch.Tensor | Pair) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return self.base(x)
        grid, prompts = x
        # L262-264: norm over every token, prompts included, then the average pool over all of them.
        tokens = torch.cat([prompts, grid.flatten(1, 2)], dim=1)
        return self.base(tokens).unsqueeze(1)


@rows.register_row_hook(PromptedSwinBlock)
def _block_rows(wrapper: PromptedSwinBlock) -> rows.RowHook:
    # A mixed batch's rows of VPT tasks run the shared frozen Swin in a pass of their own (rows_with_prompts), each
    # row with its task's prompts: this block's own (dropout is off in a served model) or those that arrive.
    prompt = None if wrapper.prompt is None else wrapper.prompt.detach()
    count = 0 if prompt is None else prompt.shape[0]
    return rows.RowHook(wrapper.base, prompts=count, pool_prompts=not wrapper.strip, beside=True, own_prompts=prompt)


@rows.register_row_hook(PromptedPatchMerging)
@rows.register_row_hook(PromptedFinalNorm)
def _beside_rows(wrapper: nn.Module) -> rows.RowHook:
    # Nothing of the task's own: the pass merges and normalises the prompts with the shared modules.
    return rows.RowHook(wrapper.base, beside=True)


def rows_with_prompts(
    model: nn.Module, grid: torch.Tensor, prompts: list[tuple[torch.Tensor, torch.Tensor | None] | None]
) -> Pair:
    """The stages of a plain timm Swin ``model`` on an embedded ``grid``, each row with prompts of its own beside it.

    What a prompted Swin's blocks, mergings and stages do (:func:`insert_prompts`), for rows whose prompts differ:
    the rows of several VPT tasks with the same prompt count in one pass of the frozen Swin (:class:`petl.MultiTask`).

    Args:
        model: a timm SwinTransformer without prompts (its modules run as the prompted wrappers run theirs).
        grid: the patch embedding's output (rows, H, W, C).
        prompts: per block, ``(own, use)``: each row's prompts for the block (rows, n, width) and which rows put
            them in place of those arriving (rows, bool; ``None``: every row), or ``None``: every row carries its own.
            The first block's are every row's.

    Returns:
        The last stage's grid and each row's prompts beside it.

    """
    carried, i = None, 0
    for stage in model.layers:
        grid = stage.downsample(grid)
        if carried is not None and not isinstance(stage.downsample, nn.Identity):
            carried = merged_prompts(stage.downsample, carried)
        for block in stage.blocks:
            if prompts[i] is not None:
                own, use = prompts[i]
                own = own.to(grid.dtype)
                carried = own if use is None else torch.where(use.view(-1, 1, 1), own, carried)
            grid, carried = prompted_block(block, grid, carried)
            i += 1
    return grid, carried


def prompted_block(block: nn.Module, grid: torch.Tensor, prompts: torch.Tensor) -> Pair:
    """One timm SwinTransformerBlock on ``grid`` (B, H, W, C) with ``prompts`` (B, n, C) in every window (L367-445)."""
    b, h, w, c = grid.shape
    n = prompts.shape[1]
    attn_grid, attn_prompts = _windowed_attention(block, block.norm1(grid), block.norm1(prompts))
    # Both residual halves run on prompts and grid as one sequence (L438-443), so DropPath draws once per image.
    x = torch.cat([prompts, grid.reshape(b, -1, c)], dim=1)
    x = x + block.drop_path1(torch.cat([attn_prompts, attn_grid.reshape(b, -1, c)], dim=1))
    x = x + block.drop_path2(block.mlp(block.norm2(x)))
    return x[:, n:].reshape(b, h, w, c), x[:, :n]


def _windowed_attention(block: nn.Module, grid: torch.Tensor, prompts: torch.Tensor) -> Pair:
    """The windowed attention of timm's ``SwinTransformerBlock._attn``, each image's prompts in its windows."""
    b, h, w, c = grid.shape
    (win_h, win_w), (shift_h, shift_w) = block.window_size, block.shift_size
    shifted = torch.roll(grid, shifts=(-shift_h, -shift_w), dims=(1, 2)) if shift_h or shift_w else grid
    shifted = F.pad(shifted, (0, 0, 0, (win_w - w % win_w) % win_w, 0, (win_h - h % win_h) % win_h))
    _, hp, wp, _ = shifted.shape
    windows = window_partition(shifted, block.window_size).view(-1, win_h * win_w, c)
    mask = block.get_attn_mask(shifted) if getattr(block, "dynamic_mask", False) else block.attn_mask
    out, attn_prompts = prompted_window_attention(block.attn, windows, prompts, mask)
    out = window_reverse(out.reshape(-1, win_h, win_w, c), block.window_size, hp, wp)[:, :h, :w]
    if shift_h or shift_w:
        out = torch.roll(out, shifts=(shift_h, shift_w), dims=(1, 2))
    return out, attn_prompts


def prompted_window_attention(
    attn: nn.Module, windows: torch.Tensor, prompts: torch.Tensor, mask: torch.Tensor | None
) -> Pair:
    """The ``WindowAttention`` of timm on ``windows`` with each image's ``prompts`` in front of its windows (L459-522).

    Args:
        attn: timm's WindowAttention.
        windows: (B * windows per image, window tokens, C), image by image as ``window_partition`` lists them.
        prompts: (B, n, C), each image's prompts.
        mask: the shifted-window mask (windows per image, window tokens, window tokens), or ``None``.

    Returns:
        The windows' outputs (as ``windows``) and each prompt's output averaged over its image's windows (B, n, C)
        (L411-419).

    The relative-position bias and the shifted-window mask know the window's tokens only; both are zero for every
    pair that involves a prompt (L480-491, L499-508).  The reference copies the prompts into every window before
    ``qkv`` and averages the prompt rows over the windows after ``proj``; two rewrites give the same numbers with
    the prompts' Linears run once per image instead of once per window:

    * ``qkv`` acts token by token, so every copy of a prompt gets the same q, k and v: they are computed once per
      image and repeated for its windows.  (A dropout inside a wrapped ``qkv`` then draws one mask per prompt, not
      one per copy; the reference has none there.)
    * An average over the windows is a weighted sum whose weights sum to one, which an affine map commutes with:
      mean(W y_i + b) = W mean(y_i) + b.  So where ``proj_drop(proj(.))`` is affine (``proj`` an ``nn.Linear``,
      ``proj_drop`` off: p = 0 or eval) the prompt rows are averaged before ``proj``, which then runs on n rows
      per image.  Any other ``proj`` (a wrapper, which is not known to be affine here), or a dropout that draws
      a mask per copy, takes the reference's order: ``proj`` on every window's prompt rows, then the average.

    A third applies where an image has several windows and its prompts outnumber a window's tokens (VPT-shallow's
    100 prompts): the prompts' attention among themselves, the same in every window, is computed once per image
    (:func:`_prompts_apart`), unless a dropout acts on the attention weights.
    """
    rows, tokens, _ = windows.shape
    b, n, _ = prompts.shape
    num_windows = rows // b
    dropout = attn.attn_drop.p if attn.training else 0.0
    affine = _affine_proj(attn)
    if num_windows > 1 and n >= tokens and dropout == 0 and affine:
        windows_out, prompts_out = _prompts_apart(attn, windows, prompts, mask)
        return attn.proj_drop(attn.proj(windows_out)), attn.proj_drop(attn.proj(prompts_out))
    windows_out, prompts_out = _prompts_in_every_window(attn, windows, prompts, mask, dropout)
    if not affine:
        # proj on every window's prompt rows and its tokens in one call (one dropout draw over both), then the average.
        out = attn.proj_drop(attn.proj(torch.cat([prompts_out.reshape(rows, n, -1), windows_out], dim=1)))
        return out[:, n:], out[:, :n].reshape(b, num_windows, n, -1).mean(dim=1)
    return attn.proj_drop(attn.proj(windows_out)), attn.proj_drop(attn.proj(prompts_out.mean(dim=1)))


def _prompts_in_every_window(
    attn: nn.Module, windows: torch.Tensor, prompts: torch.Tensor, mask: torch.Tensor | None, dropout: float
) -> Pair:
    """Each window's attention over its image's prompts and its own tokens, as one sequence of n + tokens (L459-522).

    Returns the windows' rows (rows, tokens, C) and every window's prompt rows (B, windows per image, n, C), before
    ``proj``.
    """
    rows, tokens, _ = windows.shape
    b, n, _ = prompts.shape
    num_windows, heads = rows // b, attn.num_heads
    # Image i's prompts' q, k, v in front of each of its windows', in the (rows, n + tokens, 3 * width) layout qkv
    # gives, so that q, k, v are the strided views timm's own attention hands the fused kernel.
    qkv = attn.qkv(windows)
    qkv_prompts = attn.qkv(prompts).unsqueeze(1).expand(-1, num_windows, -1, -1)
    qkv = torch.cat([qkv_prompts, qkv.reshape(b, num_windows, tokens, -1)], dim=2)
    q, k, v = qkv.reshape(rows, n + tokens, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    pad = (n, 0, n, 0)
    bias = F.pad(attn._get_rel_pos_bias(), pad)  # 1, heads, n + tokens, n + tokens
    if mask is not None:
        mask = F.pad(mask, pad).view(1, num_windows, 1, n + tokens, n + tokens)
        bias = (bias.unsqueeze(1) + mask).expand(b, -1, -1, -1, -1).reshape(rows, -1, n + tokens, n + tokens)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=attn.scale)
    out = out.transpose(1, 2).reshape(rows, n + tokens, -1)
    return out[:, n:], out[:, :n].reshape(b, num_windows, n, -1)


def _prompts_apart(attn: nn.Module, windows: torch.Tensor, prompts: torch.Tensor, mask: torch.Tensor | None) -> Pair:
    """:func:`_prompts_in_every_window`'s numbers (up to float rounding), its prompt rows already averaged over the
    windows, without its prompts' attention among themselves per window.

    A prompt's row in a window attends to the image's prompts and to that window's tokens, so its softmax is a mix of
    two: the softmax over the prompts, the same in every window (no bias or mask between prompts), computed once
    per image, and the softmax over the window's tokens; the prompts' share of the mix is the sigmoid of the two
    parts' log-sum-exp difference (the merge a fused attention kernel does between the blocks of a row).  The
    average over the windows then sums each window's part weighted by its share, in one matmul over every token of
    the image.  Of the (n + tokens)² scores a window costs, the n² among the prompts go from once per window to
    once per image: where the prompts outnumber a window's tokens (VPT-shallow's 100 beside 16 in petl's Swin), most
    of the attention.  The windows' own rows attend to the prompts and their tokens in one kernel call, as before.
    Only without dropout on the attention weights (a dropout draws per window) and with an affine ``proj`` (only the
    average is kept).

    Returns:
        The windows' rows (rows, tokens, C) and each image's prompt rows averaged over its windows (B, n, C), before
        ``proj``.

    """
    rows, tokens, width = windows.shape
    b, n, _ = prompts.shape
    num_windows, heads = rows // b, attn.num_heads
    q, k, v = attn.qkv(windows).reshape(rows, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    qp, kp, vp = attn.qkv(prompts).reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # B, heads, n, d

    # The windows' rows: keys and values of the image's prompts, then of the window's own tokens.
    def with_prompts(prompt_part: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        every_window = prompt_part.unsqueeze(1).expand(-1, num_windows, -1, -1, -1).reshape(rows, heads, n, -1)
        return torch.cat([every_window, own], dim=2)

    bias = F.pad(attn._get_rel_pos_bias(), (n, 0))  # 1, heads, tokens, n + tokens
    if mask is not None:
        mask = F.pad(mask, (n, 0)).view(1, num_windows, 1, tokens, n + tokens)
        bias = (bias.unsqueeze(1) + mask).expand(b, -1, -1, -1, -1).reshape(rows, heads, tokens, n + tokens)
    out = F.scaled_dot_product_attention(
        q, with_prompts(kp, k), with_prompts(vp, v), attn_mask=bias.to(q.dtype), scale=attn.scale
    )
    windows_out = out.transpose(1, 2).reshape(rows, tokens, width)

    # The prompts' rows (softmaxes in float32, as a fused kernel keeps them): over the prompts once per image ...
    qp = qp * attn.scale
    among = (qp @ kp.transpose(-1, -2)).float()  # B, heads, n, n
    from_prompts = torch.softmax(among, dim=-1).to(vp.dtype) @ vp  # B, heads, n, d
    # ... and over each window's tokens: the image's tokens window after window, one score per prompt and token.
    k_image = k.view(b, num_windows, heads, tokens, -1).transpose(1, 2).reshape(b, heads, num_windows * tokens, -1)
    v_image = v.view(b, num_windows, heads, tokens, -1).transpose(1, 2).reshape(b, heads, num_windows * tokens, -1)
    seen = (qp @ k_image.transpose(-1, -2)).float().view(b, heads, n, num_windows, tokens)
    # Each window's mix: the prompts' part with weight share, the window's with 1 - share; averaged over windows.
    share = torch.sigmoid(torch.logsumexp(among, dim=-1).unsqueeze(-1) - torch.logsumexp(seen, dim=-1))
    weights = torch.softmax(seen, dim=-1) * ((1 - share) / num_windows).unsqueeze(-1)  # B, heads, n, windows, tokens
    mixed = weights.view(b, heads, n, -1).to(v_image.dtype) @ v_image + share.mean(dim=-1, keepdim=True) * from_prompts
    return windows_out, mixed.to(windows_out.dtype).transpose(1, 2).reshape(b, n, width)


def _affine_proj(attn: nn.Module) -> bool:
    """Whether ``attn.proj_drop(attn.proj(.))`` is affine, so that it commutes with an average over windows."""
    drop = attn.proj_drop
    off = isinstance(drop, nn.Identity) or (isinstance(drop, nn.Dropout) and (drop.p == 0 or not drop.training))
    return off and isinstance(attn.proj, nn.Linear)


def insert_prompts(model: nn.Module, prompts: list[torch.Tensor | None], dropout: float, strip: bool) -> None:
    """Wrap a timm Swin's blocks, patch mergings and final norm so that prompts run beside the grid.

    Args:
        model: a timm SwinTransformer.
        prompts: per block, in order over the stages, its prompts (tokens x the block's width) or ``None`` (carry
            the prompts that arrive); the first block needs prompts.
        dropout: dropout on the prompts.
        strip: the last block removes the prompts (the final norm and pooling see the grid alone).

    """
    places = [(stage, j) for stage in model.layers for j in range(len(stage.blocks))]
    for i, ((stage, j), prompt) in enumerate(zip(places, prompts, strict=True)):
        stage.blocks[j] = PromptedSwinBlock(stage.blocks[j], prompt, strip and i == len(places) - 1, dropout)
    for stage in list(model.layers)[1:]:
        if not isinstance(stage.downsample, nn.Identity):
            stage.downsample = PromptedPatchMerging(stage.downsample)
    if not strip:
        model.norm = PromptedFinalNorm(model.norm)


def forward_intermediates(
    model: nn.Module,
    x: torch.Tensor,
    indices: int | list[int] | None = None,
    norm: bool = False,
    stop_early: bool = False,
    output_fmt: str = "NCHW",
    intermediates_only: bool = False,
    **kwargs: Any,
) -> Any:
    """The ``SwinTransformer.forward_intermediates`` of timm on a prompted Swin: each stage's grid, prompts left out.

    The stages run as timm runs them; an intermediate is the grid of a stage's output (NCHW, the plain model's
    shapes), and the final features are ``forward_features``' (prompts included where the pooling sees them).
    """
    if output_fmt != "NCHW":
        raise ValueError(f"forward_intermediates: output_fmt={output_fmt!r}: a Swin gives NCHW only")
    if kwargs:
        raise TypeError(f"forward_intermediates: a Swin takes no {', '.join(sorted(kwargs))}")
    take, max_index = feature_take_indices(len(model.layers), indices)
    stages = model.layers if not stop_early else model.layers[: max_index + 1]
    intermediates, x, i = [], model.patch_embed(x), 0
    last = len(model.layers) - 1
    for i, stage in enumerate(stages):
        x = stage(x)
        if i in take:
            grid = x if isinstance(x, torch.Tensor) else x[0]
            # timm's norm=True applies the final norm to the last stage's map: the grid's tokens, not the prompts.
            grid = _plain(model.norm)(grid) if norm and i == last else grid
            intermediates.append(grid.permute(0, 3, 1, 2).contiguous())
    if intermediates_only:
        return intermediates
    # As timm: the final norm only after the last stage (there with the prompts, as forward_features gives them).
    if i == last:
        return model.norm(x), intermediates
    return (x if isinstance(x, torch.Tensor) else x[0]), intermediates


def _plain(norm: nn.Module) -> nn.Module:
    return norm.base if isinstance(norm, PromptedFinalNorm) else norm
