"""Collectives counted from outside: what a save or a load asks of the other ranks."""

import pickle

OBJECT_COLLECTIVES = ("gather_object", "scatter_object_list", "all_gather_object", "broadcast_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "gather", "scatter", "all_gather", "all_gather_into_tensor", "broadcast")


def count_collectives(log: list) -> None:
    """Wrap this process's collectives: each call appends (name, pickled bytes put in)."""
    import torch.distributed as dist

    def wrap(name, original):
        def call(*args, **kwargs):
            size = 0
            if name in ("gather_object", "all_gather_object"):
                size = len(
                    pickle.dumps(kwargs["obj"] if "obj" in kwargs else args[1 if name == "all_gather_object" else 0])
                )
            elif name in ("scatter_object_list", "broadcast_object_list"):
                key = "scatter_object_input_list" if name == "scatter_object_list" else "object_list"
                objects = kwargs.get(
                    key, args[1] if name == "scatter_object_list" and len(args) > 1 else (args[0] if args else None)
                )
                size = len(pickle.dumps(objects)) if objects and any(o is not None for o in objects) else 0
            log.append((name, size))
            return original(*args, **kwargs)

        return call

    for name in OBJECT_COLLECTIVES + TENSOR_COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def names(calls: list) -> list[str]:
    """The collectives' names, in call order."""
    return [name for name, _ in calls]
