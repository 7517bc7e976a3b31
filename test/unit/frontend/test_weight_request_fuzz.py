"""Any body of the weight routes (/update_weights_from_disk, /update_weights_from_tensor, the weight-update
group's, /get_weights_by_name, /release_memory_occupation, /resume_memory_occupation, /update_weight_version)
parses to a request or raises a 400 naming one of its fields, never another error (a 500): random JSON
values, shaped like the valid ones (lists of the same length), in a few fields of an otherwise valid
body, through the parsers the HTTP server and the Engine run. It fails on a shape with a null size when
the sizes' integer check is dropped."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.managers import io_struct
from sglang.srt.managers import weight_update_request as w
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2, 65535, 65536]),
    st.floats(allow_nan=False), st.text(max_size=6),
    st.sampled_from(["", "bfloat16", "torch.float32", "int8", "weights", "kv_cache", "direct", "gloo"]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def like(value):
    """Values shaped like a valid `value` (a list of its length, whose items are like its items) with
    anything inside, or any JSON value: a bad item must be caught as well as a bad length."""
    if isinstance(value, list) and value:
        return st.lists(like(value[0]), min_size=len(value), max_size=len(value)) | json_values
    return json_values


# Each route's parser and a valid body to start from.
ROUTES = {
    "disk": (w.parse_update_weights_from_disk, {"model_path": "/m"}, io_struct.UpdateWeightFromDiskReqInput),
    "tensor": (w.parse_update_weights_from_tensor, {"serialized_named_tensors": ["eA=="]},
               io_struct.UpdateWeightsFromTensorReqInput),
    "init": (w.parse_init_weights_update_group,
             {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2},
             io_struct.InitWeightsUpdateGroupReqInput),
    "distributed": (w.parse_update_weights_from_distributed,
                    {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]]},
                    io_struct.UpdateWeightsFromDistributedReqInput),
    "destroy": (w.parse_destroy_weights_update_group, {}, io_struct.DestroyWeightsUpdateGroupReqInput),
    "get": (w.parse_get_weights_by_name, {"name": "a"}, io_struct.GetWeightsByNameReqInput),
    "release": (lambda b: w.parse_memory_occupation(b, io_struct.ReleaseMemoryOccupationReqInput), {},
                io_struct.ReleaseMemoryOccupationReqInput),
    "version": (w.parse_update_weight_version, {"new_version": "v"}, None),
}  # fmt: skip


def fields_of(route: str) -> list[str]:
    cls = ROUTES[route][2]
    if cls is None:  # /update_weight_version's body has no class
        return ["new_version", "abort_all_requests"]
    return [f.name for f in dataclasses.fields(cls)]  # `trusted` too: a body may not set it


def replaced_fields(route: str):
    """One to three fields of the route's body, each with a value `like` its valid one."""
    valid = ROUTES[route][1]
    names = st.lists(st.sampled_from(fields_of(route)), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda ns: st.fixed_dictionaries({n: like(valid.get(n)) for n in ns}))


bodies = st.sampled_from(sorted(ROUTES)).flatmap(
    lambda route: st.tuples(st.just(route), replaced_fields(route))
)


@settings(max_examples=800, deadline=None, derandomize=True)
@given(case=bodies, not_an_object=st.booleans())
def test_any_weight_route_body_is_a_request_or_a_named_400(case, not_an_object):
    route, fields = case
    parse, valid, _ = ROUTES[route]
    body = [fields] if not_an_object and fields else {**valid, **fields}
    try:
        obj = parse(body)
    except RequestError as e:
        assert e.message
        assert e.param is None or e.param in body, (route, e.param, e.message)
        return
    # What an accepted body promises the scheduler.
    if route == "tensor":
        assert obj.trusted is False and obj.load_format in w.TENSOR_LOAD_FORMATS
    elif route == "distributed":
        assert len(obj.names) == len(obj.dtypes) == len(obj.shapes)
        assert set(obj.dtypes) <= set(w.WEIGHT_DTYPES)
        assert all(isinstance(d, int) and d >= 0 for s in obj.shapes for d in s)
    elif route == "init":
        assert 0 < obj.rank_offset < obj.world_size and obj.backend in w.GROUP_BACKENDS
    elif route == "release":
        assert obj.tags and set(obj.tags) <= set(w.MEMORY_TAGS)
    elif route == "get":
        assert isinstance(obj.truncate_size, int) and obj.truncate_size >= 0
