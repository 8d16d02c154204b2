"""Pipeline parallelism: one optimizer over a rank's parts, one checkpoint for all stages.

4 ranks as 2 pipeline stages x 2 data-parallel ranks, each rank holding two parts (an
interleaved split of 4 layers), each part with dedicated matrices over its stage's
data-parallel ranks under FSDP2: it trains exactly as the same model on 2 data-parallel ranks
without pipeline (every loss, every weight), and its checkpoint, written by every stage through
``dmuon.dcp.save``, resumes at PP 1 and at PP 2 with every loss and weight of the
uninterrupted run: model and momentum restored exactly. torch's ``dcp.save`` of the parts'
merged ``state_dict()`` writes every weight too; the flat-dict gathers refuse (they would wait
on ranks of the other stage forever).
"""
import torch

from tests.helpers.launch import run_ranks

STEPS, SAVED_AT = 4, 2


def pipeline_worker(rank, world, pp, virtual, folder, *, save_at=None, load=False):
    import torch.distributed as dist
    import torch.distributed.checkpoint as torch_dcp

    import dmuon
    import dmuon.dcp as ddcp
    from tests.helpers.pipeline import build, train_step

    parts, model, opt, stage = build(pp, virtual)
    start = 0
    if load:
        ddcp.load(model, opt, f"{folder}/step-{SAVED_AT}")
        start = SAVED_AT
    losses = {}
    for step in range(start, STEPS):
        loss = train_step(parts, stage, pp, step)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses[step] = loss
        if save_at == step + 1:
            ddcp.save(model, opt, f"{folder}/step-{save_at}")
    ddcp.save(model, opt, f"{folder}/final-{pp}x{virtual}-{int(load)}")
    if pp > 1 and not load:
        # torch's own door: the merged state dict of the parts, torch's default planner
        torch_dcp.save({"model": model.state_dict()}, checkpoint_id=f"{folder}/torch-{pp}x{virtual}")
        try:
            dmuon.get_model_state_dict(model)
        except dmuon.StateDictError as exc:
            refused = str(exc)
        else:
            refused = ""
        assert "pipeline stage" in refused and "dmuon.dcp.save" in refused, refused
    gathered = [None] * world
    dist.all_gather_object(gathered, losses)
    return {k: v for found in gathered for k, v in found.items()}


def final_state(folder, name):
    """Every weight and momentum of a checkpoint, read back in one process (no dmuon)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = f"{folder}/{name}"
    metadata = FileSystemReader(path).read_metadata()
    wanted = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if (key.startswith("model.") or key.endswith(".momentum_buffer")) and hasattr(md, "size")
    }
    dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
    return wanted


def test_pipeline_parts_train_as_the_whole_model_and_resume_at_any_pipeline_degree(tmp_path):
    whole = run_ranks(pipeline_worker, 2, 1, 1, str(tmp_path), timeout=120)[0]
    piped = run_ranks(pipeline_worker, 4, 2, 2, str(tmp_path), save_at=SAVED_AT, timeout=120)[0]
    assert sorted(piped) == list(range(STEPS))
    assert piped == whole  # every loss, bit for bit
    reference = final_state(tmp_path, "final-1x1-0")
    pp_state = final_state(tmp_path, "final-2x2-0")
    assert pp_state.keys() == reference.keys() and any(k.endswith("momentum_buffer") for k in reference)
    torch_saved = final_state(tmp_path, "torch-2x2")
    for key, value in reference.items():
        assert torch.equal(pp_state[key], value), key
        if key.startswith("model."):
            assert torch.equal(torch_saved[key], value), key
    # the one checkpoint of all stages, resumed without pipeline and with it
    for world, pp, virtual in ((2, 1, 1), (4, 2, 2)):
        resumed = run_ranks(pipeline_worker, world, pp, virtual, str(tmp_path), load=True, timeout=120)[0]
        assert resumed == {s: whole[s] for s in range(SAVED_AT, STEPS)}, (pp, virtual)
        after = final_state(tmp_path, f"final-{pp}x{virtual}-1")
        for key, value in reference.items():
            assert torch.equal(after[key], value), (pp, key)
