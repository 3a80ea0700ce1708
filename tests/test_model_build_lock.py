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


def test_a_version_built_while_another_thread_starts_a_build_is_whole(tiny_moe_dir, monkeypatch):
    """The second half of a build (assigning the version's tensors, which goes through
    ``register_parameter``) is under the lock too: a build that starts in another thread
    meanwhile waits, and the first model gets no meta tensor."""
    import torch

    state = {k: v.clone() for k, v in load_model(tiny_moe_dir).state_dict().items()}
    assigning, patched, assigned = threading.Event(), threading.Event(), threading.Event()
    real = torch.nn.Module.load_state_dict

    def load_after_a_chance(self, *args, **kwargs):  # give the other thread its chance to patch first
        assigning.set()
        patched.wait(2.0)  # (it cannot while this build holds the lock: the wait runs out)
        try:
            return real(self, *args, **kwargs)
        finally:
            assigned.set()

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", load_after_a_chance)

    def other_build():  # another thread's build, its patch held until the assignment is done
        assert assigning.wait(30)
        with _parameters_on_meta():
            patched.set()
            assigned.wait(30)

    other = threading.Thread(target=other_build)
    other.start()
    model = build_model(tiny_moe_dir, state)
    other.join(30)
    meta = sorted(k for k, v in model.state_dict().items() if v.device.type == "meta")
    assert meta == [], meta
