"""CUDA graphs of a MultiTask's forward (petl.deploy.graphs): one per batch layout, replayed where a layout repeats.

A graph itself needs a GPU (the tests marked ``cuda``); what decides when one is captured, which batches it answers
and what it holds is checked on the CPU with a stand-in graph that replays by running the eager forward it captured.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_tiny_swin, make_tiny_vit
from test_multitask import BATCHED, OTHER_SETS_OPS, _mixed_batch, _run_folder, _save, _task_set, stacked  # noqa: F401

import petl
from petl.deploy import multitask as multitask_module
from petl.deploy.graphs import LayoutGraph, LayoutGraphs, storage_of
from petl.model.backbone import backbone_of
from petl.utils.ops import CountOps


def _stand_in_capture(run, images, layout, weights):
    """A LayoutGraph whose replay runs ``run`` on its static images and the layout it was made with, into its
    output: the tensors a CUDA graph reads at a replay, as they are then."""
    with torch.inference_mode():  # as capture makes them
        static = images.clone()
        output = run(static, layout).clone()

    class Replay:
        def replay(self):
            output.copy_(run(static, layout))

    return LayoutGraph(Replay(), static, output, layout, weights)


def test_a_graph_is_made_on_a_gpu_only(stacked):  # noqa: F811
    _, _, multi, _ = stacked
    with pytest.raises(
        ValueError, match="^MultiTask.graphed makes a CUDA graph: give images on a CUDA device, not cpu$"
    ):
        multi.graphed(torch.randn(2, 3, 32, 32), ["ssf", "lora_qv"])


def test_a_layout_graph_copies_the_images_in_replays_and_holds_what_the_graph_reads(stacked):  # noqa: F811
    """The captured graph reads the layout's row order and masks, made before the capture: the object called holds
    them (freed, their memory would go to other tensors while the graph reads it), and a call copies the images into
    the graph's input (and another layout's row order and task indices, where given, into its own), replays it and
    returns a copy of its output, refusing another shape in one line."""
    _, _, multi, _ = stacked
    images = torch.randn(4, 3, 32, 32)
    layout = multi._layout(multi.task_index(["ssf", "lora_qv", "ssf", "fact"], 4), images)
    static, output, replays = torch.zeros_like(images), torch.arange(4.0), []

    class Graph:
        def replay(self):
            replays.append((static.clone(), layout.order.clone()))
            output.add_(1.0)

    graph = LayoutGraph(Graph(), static, output, layout)
    assert graph.layout is layout and graph.layout.order.tolist() == [1, 3, 0, 2]
    answer = graph(images)
    assert torch.equal(replays[0][0], images) and answer.tolist() == [1.0, 2.0, 3.0, 4.0]
    output.zero_()
    assert answer.tolist() == [1.0, 2.0, 3.0, 4.0]  # a copy, not the graph's own output
    other = multi._layout(multi.task_index(["fact", "ssf", "lora_qv", "ssf"], 4), images)  # as many of each task
    graph(images, other)
    assert replays[1][1].tolist() == other.order.tolist() == [2, 0, 1, 3] and layout.order.tolist() == [2, 0, 1, 3]
    with pytest.raises(ValueError, match=r"^this graph answers \(4, 3, 32, 32\) torch.float32 images on cpu, got "):
        graph(images[:2])


def test_a_graph_holds_the_storage_of_the_weights_it_captured(tmp_path):
    """A graph reads the weights' memory as it was at the capture: a ``.to()`` after it gives each Parameter new
    storage and frees the old, which the graph would go on reading (whatever took its place)."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, {"lora": BATCHED["lora_qv"], "ssf": BATCHED["ssf"]}, backbone)
    multi = petl.MultiTask(backbone, files)
    held = storage_of(multi)
    captured = {t.data_ptr() for t in held}
    assert captured == {t.data_ptr() for t in (*multi.parameters(), *multi.buffers())}
    multi.to(torch.float64)
    assert {t.data_ptr() for t in held} == captured and all(t.dtype == torch.float32 for t in held)
    assert not captured & {p.data_ptr() for p in multi.parameters()}


def test_a_graph_holds_the_tables_its_masks_are_gathered_from(tmp_path, monkeypatch):
    """Each row's prompt-slot masks are gathered from tables the MultiTask makes once per device, dtype and token
    count, in a capture's warm-up at the latest: the graph holds them too, since a ``.to()`` drops them there."""
    backbone = make_tiny_vit(global_pool="avg")
    _, files = _save(tmp_path, {"lora": BATCHED["lora_qv"], "vpt": BATCHED["vpt_2"]}, backbone)
    multi = petl.MultiTask(backbone, files)
    monkeypatch.setattr(multitask_module, "capture", _stand_in_capture)
    images = torch.randn(4, 3, 32, 32)
    index = multi.task_index(["lora", "vpt", "vpt", "lora"], 4)
    graph = multi._capture(images, multi._layout(index, images, every_row=True))
    tables = list(multi._mask_tables.values())
    assert [t.dtype for t in tables] == [torch.bool, torch.float32]  # the pooling's, the attention's
    assert {t.data_ptr() for t in tables} <= {t.data_ptr() for t in graph.weights}
    multi.to(torch.float64)
    assert not multi._mask_tables


class _Made:
    """A stand-in ``make`` for LayoutGraphs.answer: counts its calls; its graphs answer their key's name."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, key: str):
        def make():
            self.keys.append(key)
            return lambda images, order: f"graph of {key}"

        return make


class _Layout:
    order = None


def test_a_layout_is_captured_the_second_time_it_comes_and_replayed_after():
    made, graphs = _Made(), LayoutGraphs(size=8, after=2)
    answers = [graphs.answer(key, None, _Layout(), made(key)) for key in ["a", "b", "a", "a", "b", "c"]]
    assert answers == [None, None, "graph of a", "graph of a", "graph of b", None]
    assert made.keys == ["a", "b"] and (graphs.captured, graphs.replayed) == (2, 3)


def test_past_its_size_a_layout_takes_the_place_of_the_least_used_graph_once_it_came_more_often():
    made, graphs = _Made(), LayoutGraphs(size=2, after=1)
    answers = [graphs.answer(key, None, _Layout(), made(key)) for key in ["a", "b", "a", "c", "c", "b"]]
    # c, once, is no more used than b (a batch each): no capture; twice, it is, and takes b's place, which, back,
    # has come once since, less than a or c.
    assert answers == ["graph of a", "graph of b", "graph of a", None, "graph of c", None]
    assert list(graphs.graphs) == ["a", "c"] and made.keys == ["a", "b", "c"]


def test_size_zero_keeps_no_graph_and_layouts_that_never_repeat_are_forgotten():
    made = _Made()
    off = LayoutGraphs(size=0, after=1)
    assert off.answer("a", None, _Layout(), made("a")) is None and made.keys == [] and not off.uses
    graphs = LayoutGraphs(size=1, after=2)
    for key in range(200):
        assert graphs.answer(key, None, _Layout(), made(key)) is None
        assert len(graphs.uses) <= 65
    assert made.keys == []


def test_lowering_the_size_drops_the_least_used_graphs_past_it():
    """Each graph holds the GPU memory of its forward: ``size = 0`` (documented as turning the graphs off) kept every
    graph captured so far, and a lower size kept them all until a capture replaced one."""
    made, graphs = _Made(), LayoutGraphs(size=3, after=1)
    for key in ["a", "a", "a", "b", "b", "c"]:
        graphs.answer(key, None, _Layout(), made(key))
    assert list(graphs.graphs) == ["a", "b", "c"]
    graphs.size = 2
    assert list(graphs.graphs) == ["a", "b"]
    graphs.size = 0
    assert not graphs.graphs and graphs.answer("a", None, _Layout(), made("a")) is None and made.keys == ["a", "b", "c"]


def test_the_graph_a_layout_replaces_is_dropped_before_its_capture():
    """Its memory is then free for the capture: kept until after it, the graphs held ``size + 1`` forwards'
    intermediate tensors at once, and a capture that ran out of memory for it turned every graph off."""
    held = []
    graphs = LayoutGraphs(size=1, after=1)

    def make(key):
        def capture():
            held.append(list(graphs.graphs))
            return lambda images, order: key

        return capture

    assert [graphs.answer(key, None, _Layout(), make(key)) for key in ["a", "b", "b"]] == ["a", None, "b"]
    assert held == [[], []] and list(graphs.graphs) == ["b"]


def test_a_capture_that_fails_turns_the_graphs_off_with_a_warning():
    def fails():
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = LayoutGraphs(size=8, after=1)
    with pytest.warns(UserWarning, match=r"serves every batch eagerly: capturing a CUDA graph failed \(operation not"):
        assert graphs.answer("a", None, _Layout(), fails) is None
    assert graphs.size == 0 and not graphs.uses and graphs.answer("a", None, _Layout(), _Made()("a")) is None


def test_forward_replays_one_graph_for_every_batch_with_as_many_rows_of_each_task(stacked, monkeypatch):  # noqa: F811
    """The graph of a layout reads the batch's row order from a tensor it is copied into: a batch of the same tasks'
    rows in another order gets the forward's logits from it, a batch with other counts a graph of its own, and a
    ``.to()`` drops every graph (they read the weights' old memory).  (A set of tasks that cannot run every row, as
    one with a side network, is served so; these tasks could, which is turned off here.)"""
    _, files, _, backbone = stacked
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    multi.every_row = False
    monkeypatch.setattr(multitask_module, "_may_replay", lambda images: not torch.is_grad_enabled())
    monkeypatch.setattr(multitask_module, "capture", _stand_in_capture)
    names = ["lora_qv", "ssf", "adapter", "vpt_5", "fact"]
    ids, images = _mixed_batch(names, per_task=2)
    batches = [(ids, images)]
    for seed in (1, 2):  # the same two rows of each task, in other orders
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
        batches.append(([ids[i] for i in order], torch.randn_like(images)))
    with torch.no_grad():
        multi.graphs.size = 0
        eager = [multi(b, i) for i, b in batches]
        multi.graphs.size = 8
        for _ in range(2):
            answers = [multi(b, i) for i, b in batches]
            torch.testing.assert_close(answers, eager, rtol=1e-5, atol=1e-5)
        assert not any(torch.is_inference(answer) for answer in answers)  # as eager under no_grad: autograd takes it
        assert (multi.graphs.captured, multi.graphs.replayed) == (1, 5)
        other = ids[:-1] + ["ssf"]
        multi(images, other), multi(images, other)
        assert multi.graphs.captured == 2 and len(multi.graphs.graphs) == 2
    with torch.enable_grad():  # autograd: eager, no graph
        multi(images, ids)
    assert multi.graphs.replayed == 6
    multi.to(torch.float64)
    assert not multi.graphs.graphs and not multi.graphs.uses


@pytest.mark.cuda
@pytest.mark.parametrize("task_set", ["8 methods", *sorted(OTHER_SETS_OPS)])
def test_a_graph_of_a_layout_answers_as_the_forward(tmp_path, monkeypatch, task_set):
    """A CUDA graph of one batch layout gives every row the forward's logits, on other images of that layout too,
    and refuses a batch of another shape; forward's own graphs answer batches with as many rows of each task in any
    order, under bf16 autocast too (petl-predict's and petl-serve's default on a GPU)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, _task_set(task_set), backbone)
    ids, images = _mixed_batch(list(files), per_task=4)
    multi = petl.MultiTask(backbone, files).cuda()
    images = images.cuda()
    replay = multi.graphed(images, ids)
    assert {t.data_ptr() for t in replay.weights} == {t.data_ptr() for t in (*multi.parameters(), *multi.buffers())}
    with torch.no_grad():
        multi.graphs.size = 0
        for batch in (images, torch.randn_like(images), images.flip(0)):
            torch.testing.assert_close(replay(batch), multi(batch, ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"^this graph answers \(\d+, 3, 32, 32\) torch.float32 images on cuda:0"):
        replay(images[:-1])
    shuffled = ids[::-1]
    for autocast in (False, True):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), torch.no_grad():
            multi.graphs.size = 0
            eager = [multi(images, ids), multi(images.flip(0), shuffled)]
            multi.graphs.size = 8
            for _ in range(2):
                graphed = [multi(images, ids), multi(images.flip(0), shuffled)]
            tolerance = 1e-2 if autocast else 1e-4
            torch.testing.assert_close(graphed, eager, atol=tolerance, rtol=tolerance)
    assert multi.graphs.captured == 2 and multi.graphs.replayed == 6


def test_petl_serve_counts_the_batches_a_graph_answered(tmp_path, monkeypatch):
    serve = pytest.importorskip("petl.deploy.serve", reason="petl-serve's extra is not installed")
    for name, method in (("lora", "lora"), ("ssf", "ssf")):
        _run_folder(tmp_path / name, method, {}, seed=0)
    served, tasks = serve.load_tasks({"lora": tmp_path / "lora", "ssf": tmp_path / "ssf"})
    monkeypatch.setattr(multitask_module, "_may_replay", lambda images: not torch.is_grad_enabled())
    monkeypatch.setattr(multitask_module, "capture", _stand_in_capture)
    app = serve.create_app(served, tasks, serve.ServeOptions(precision="no"))
    images = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        # LoRA and SSF stack at every module: one graph answers any mix of the two (every_row), from the 2nd batch.
        for rows in ([0, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 1]):
            app.state.batcher.forward(images, torch.tensor(rows))
    assert served.every_row and "\npetl_graph_batches_total 3\n" in app.state.metrics.text()


def test_petl_predicts_full_batches_of_several_runs_replay_one_graph(tmp_path, monkeypatch):
    """Each full batch holds every image once per run: one layout, whose graph answers from the second batch on, with
    the predictions every batch gets eagerly."""
    from PIL import Image

    from petl.deploy import predict

    for name, method in (("lora", "lora"), ("ssf", "ssf")):
        _run_folder(tmp_path / name, method, {}, seed=0)
    paths = []
    for i in range(7):  # three full batches of two images (x two runs) and one of one image
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8).numpy()).save(paths[-1])
    served, runs, refused = predict.serve_together([tmp_path / "lora", tmp_path / "ssf"], quiet=True)
    assert not refused
    monkeypatch.setattr(multitask_module, "_may_replay", lambda images: not torch.is_grad_enabled())
    monkeypatch.setattr(multitask_module, "capture", _stand_in_capture)
    answers = []
    for size in (0, 8):
        served.graphs.size = size
        answers.append(predict.predict_together(served, runs, paths, top_k=2, batch_size=4, progress=False)[0])
    assert (served.graphs.captured, served.graphs.replayed) == (1, 2)
    assert len(answers[1]) == 14
    for graphed, eager in zip(answers[1], answers[0], strict=True):
        assert (graphed.run, graphed.source, graphed.labels) == (eager.run, eager.source, eager.labels)
        assert graphed.probabilities == pytest.approx(eager.probabilities, abs=1e-6)


# Every method here stacks at every module it hooks (one task's form alone too).
EVERY_ROW = {name: BATCHED[name] for name in ("lora_qv", "lora_r4", "lora_r4_fc", "ssf", "bitfit", "adapter", "fact")}
# Two prompt counts of VPT-deep, and VPT-shallow whose pooling leaves its prompts out.
PROMPTS = {
    "vpt_2": BATCHED["vpt_2"],
    "vpt_5": BATCHED["vpt_5"],
    "vpt_img": ("vpt", {"num_tokens": 3, "pool": "img_pool"}),
}


@pytest.mark.parametrize(
    ("extra", "every_row"),
    [
        ({}, True),
        (PROMPTS, True),
        ({"convpass": ("convpass", {}), **PROMPTS}, True),
        ({"side": ("lst", {})}, False),
        ({"noah": ("noah", {})}, False),
    ],
    ids=["batched", "with prompts", "with convpass", "with a side network", "with noah"],
)
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_tasks_whose_every_hook_stacks_run_every_row_through_every_stack(tmp_path, extra, every_row, pool):
    """Where every hook has a batched form and every head is a Linear, a batch may run every row through every stack
    (each row's own entry, the neutral one for the rest), one task's form too, with slots for every task's prompts
    and each row's masks gathered from its task's: the ops then do not depend on the mix of tasks, and its rows get
    the logits of the forward that sorts them into spans, for any mix, one task or all, on a class-token pooling or
    an average one (which leaves out the slots a row's task does not fill)."""
    backbone = make_tiny_vit(global_pool=pool)
    _, files = _save(tmp_path, EVERY_ROW | extra, backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    assert multi.every_row is every_row
    if not every_row:
        return
    names = list(files)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(12, 3, 32, 32, generator=gen)
    mixes = [names[:1] * 12, names[:2] * 6, [names[i % len(names)] for i in torch.randperm(12, generator=gen)]]
    counted = []
    with torch.no_grad():
        for ids in mixes:
            index = multi.task_index(ids, len(ids))
            expected = multi(images, ids)
            multi._run(images, multi._layout(index, images, every_row=True))  # makes the mask tables once
            with CountOps() as count:
                got = multi._run(images, multi._layout(index, images, every_row=True))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            counted.append(count.ops)
    assert counted[0] == counted[1] == counted[2]  # the same ops whatever the mix


def _every_row_on_the_stand_in(tmp_path, monkeypatch) -> tuple[petl.MultiTask, list[str]]:
    """A MultiTask of the EVERY_ROW tasks whose forward replays stand-in graphs on the CPU, and the task names."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, EVERY_ROW, backbone)
    monkeypatch.setattr(multitask_module, "_may_replay", lambda images: not torch.is_grad_enabled())
    monkeypatch.setattr(multitask_module, "capture", _stand_in_capture)
    return petl.MultiTask(backbone, files), list(files)


def test_forward_replays_one_graph_for_every_mix_of_tasks_that_run_every_row(tmp_path, monkeypatch):
    multi, names = _every_row_on_the_stand_in(tmp_path, monkeypatch)
    images = torch.randn(8, 3, 32, 32)
    mixes = [names[:1] * 8, names[1:3] * 4, names + names[:1], names[3:5] + names[:6]]
    with torch.no_grad():
        multi.graphs.size = 0
        eager = [multi(images, ids) for ids in mixes]
        multi.graphs.size = 8
        graphed = [multi(images, ids) for ids in mixes]
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert (multi.graphs.captured, multi.graphs.replayed, len(multi.graphs.graphs)) == (1, 3, 1)


def test_a_batch_of_tasks_that_run_every_row_is_padded_to_the_size_of_a_graph(tmp_path, monkeypatch):
    """A graph per power of two rows (past 64, per multiple of 64) answers every batch size: a batch is padded with
    rows of zeros for it, and gets its own rows' logits, those of the eager forward."""
    assert [multitask_module._graph_rows(n) for n in (1, 2, 3, 4, 5, 33, 64, 65, 129)] == [
        1, 2, 4, 4, 8, 64, 64, 128, 192
    ]  # fmt: skip
    multi, names = _every_row_on_the_stand_in(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for rows in (3, 4, 5, 7, 8, 3):  # graphs of 4 and 8 rows, each captured at its second batch
        ids = [names[i] for i in torch.randint(len(names), (rows,), generator=gen)]
        batches.append((ids, torch.randn(rows, 3, 32, 32, generator=gen)))
    with torch.no_grad():
        multi.graphs.size = 0
        eager = [multi(images, ids) for ids, images in batches]
        multi.graphs.size = 8
        answers = [multi(images, ids) for ids, images in batches]
    torch.testing.assert_close(answers, eager, rtol=1e-5, atol=1e-5)
    assert (multi.graphs.captured, multi.graphs.replayed) == (2, 4)
    assert sorted(key[1][0] for key in multi.graphs.graphs) == [4, 8]  # the images' shape: the padded rows


@pytest.mark.cuda
def test_one_cuda_graph_answers_every_mix_of_tasks_that_run_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, EVERY_ROW | PROMPTS | {"convpass": ("convpass", {})}, backbone)
    multi = petl.MultiTask(backbone, files).cuda()
    assert multi.every_row
    names = list(files)  # 11 tasks: LoRA, SSF, BitFit, adapters, FacT, VPT's prompts, Convpass
    images = torch.randn(12, 3, 32, 32).cuda()
    mixes = [names[:1] * 12, names[7:9] * 6, names + names[:1], names[5:11] + names[:6]]
    for autocast in (False, True):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), torch.no_grad():
            multi.graphs.size = 0
            eager = [multi(images, ids) for ids in mixes]
            multi.graphs.size = 8
            for _ in range(2):
                graphed = [multi(images, ids) for ids in mixes]
        tolerance = 1e-2 if autocast else 1e-4
        torch.testing.assert_close(graphed, eager, atol=tolerance, rtol=tolerance)
    assert (multi.graphs.captured, multi.graphs.replayed) == (2, 14)


def test_a_swin_runs_every_row_through_its_windows(tmp_path):
    """A Swin's window attention sees each image as its windows (Batch.rows_of): every row's windows take its task's
    entry there too."""
    backbone = make_tiny_swin()
    tasks = {"lora": ("lora", {}), "ssf": ("ssf", {}), "bitfit": ("bitfit", {}), "adapter": ("adapter", {})}
    _, files = _save(tmp_path, tasks, backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    assert multi.every_row
    images = torch.randn(6, 3, *backbone.patch_embed.img_size)
    for ids in (["lora"] * 6, ["ssf", "lora"] * 3, [*tasks, "ssf", "lora"]):
        with torch.no_grad():
            expected = multi(images, ids)
            got = multi._run(images, multi._layout(multi.task_index(ids, 6), images, every_row=True))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _meanwhile(call) -> dict:
    """Start ``call`` in another thread, and wait for it a while (for ever where nothing holds it back): what it
    returned or raised, under "answer" or "error", once it has ended (the dict's "thread": join it)."""
    ended: dict = {}

    def run():
        try:
            ended["answer"] = call()
        except Exception as error:  # noqa: BLE001  (the test reads it)
            ended["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(1.0)  # ends first where the forward takes no lock; with one it waits for this forward to end
    ended["thread"] = thread
    return ended


def test_a_forward_from_another_thread_waits_for_the_one_running(tmp_path):
    """A batch's routing is state the routed modules read (Router.batch): a forward from another thread ran in the
    middle of one and, at its end, cleared it, so that the first failed ('runs only inside MultiTask.forward'), or
    read the other's rows.  Each now gets its own logits, one after the other."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, {"lora": BATCHED["lora_qv"], "ssf": BATCHED["ssf"], "vpt": BATCHED["vpt_5"]}, backbone)
    multi = petl.MultiTask(backbone, files)
    first, other = (torch.randn(4, 3, 32, 32), ["lora", "ssf", "vpt", "lora"]), (torch.randn(3, 3, 32, 32), ["vpt"] * 3)
    with torch.no_grad():
        expected = [multi(*first), multi(*other)]
    meanwhile = []

    def midway(module, args):  # in the first forward's second block, the other forward from another thread
        if not meanwhile:
            meanwhile.append(_meanwhile(lambda: multi(*other)))

    backbone_of(multi.backbone).block_container()[1].register_forward_pre_hook(midway)
    with torch.no_grad():
        answer = multi(*first)
    meanwhile[0]["thread"].join()
    assert "error" not in meanwhile[0]
    torch.testing.assert_close([answer, meanwhile[0]["answer"]], expected, rtol=0, atol=0)


def test_a_layout_graph_called_from_two_threads_answers_each_its_own_images(stacked):  # noqa: F811
    """Another thread's call copied its images into the graph's input while this one's replay was running."""
    _, _, multi, _ = stacked
    images = torch.randn(2, 3, 32, 32)
    layout = multi._layout(multi.task_index(["ssf", "fact"], 2), images)
    static, output, meanwhile = torch.zeros_like(images), torch.zeros(2), []

    class Graph:
        def replay(self):
            if not meanwhile:  # another thread's call of other images while this replay runs
                meanwhile.append(_meanwhile(lambda: graph(images + 1)))
            output.copy_(static.mean(dim=(1, 2, 3)))

    graph = LayoutGraph(Graph(), static, output, layout)
    answer = graph(images)
    meanwhile[0]["thread"].join()
    torch.testing.assert_close(answer, images.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(meanwhile[0]["answer"], (images + 1).mean(dim=(1, 2, 3)))
