"""Two model builds in one process at once: a version's build (parameters on the meta device
under a process-wide patch) never leaves another thread's model with meta tensors.

A pod builds a version's model in its watch or admin thread while another thread of the same
process loads a checkpoint (another pod in a test process, a store's ``init_base``); the
patch of ``torch.nn.Module.register_parameter`` that :func:`schemas.modelspec.build_model`
applies used to catch the other thread's parameters too (a state dict with a
``(vocab, hidden)`` meta tensor, found on a busy box).
"""

import threading

from schemas.modelspec import _parameters_on_meta, build_model, load_model


def test_a_checkpoint_loaded_while_a_version_is_built_has_no_meta_tensor(tiny_moe_dir):
    inside, leave = threading.Event(), threading.Event()

    def build_in_progress():  # a version's build, held open until the other load has run or waited
        with _parameters_on_meta():
            inside.set()
            leave.wait(30)

    builder = threading.Thread(target=build_in_progress)
    builder.start()
    assert inside.wait(30)
    got = {}
    loader = threading.Thread(target=lambda: got.update(load_model(tiny_moe_dir).state_dict()))
    loader.start()
    loader.join(2.0)  # unpatched, the load runs to its end under the other thread's patch
    leave.set()
    builder.join(30)
    loader.join(60)
    assert got, "the load did not finish"
    meta = sorted(k for k, v in got.items() if v.device.type == "meta")
    assert meta == [], meta
    # and a version built from that state is whole (its own build still puts nothing on meta
    # once it has assigned the tensors)
    model = build_model(tiny_moe_dir, {k: v.clone() for k, v in got.items()})
    assert all(v.device.type == "cpu" for v in model.state_dict().values())
