from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetMessage(_message.Message):
    __slots__ = ("hello", "propose", "verify", "release", "hidden_rows", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    propose: ProposeBatch
    verify: VerifyBatch
    release: ReleaseBatch
    hidden_rows: HiddenRows
    step: StepNews
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., propose: _Optional[_Union[ProposeBatch, _Mapping]] = ..., verify: _Optional[_Union[VerifyBatch, _Mapping]] = ..., release: _Optional[_Union[ReleaseBatch, _Mapping]] = ..., hidden_rows: _Optional[_Union[HiddenRows, _Mapping]] = ..., step: _Optional[_Union[StepNews, _Mapping]] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("hello_ack", "proposals")
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    hello_ack: HelloAck
    proposals: ProposalBatch
    def __init__(self, hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., proposals: _Optional[_Union[ProposalBatch, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("target_id", "model", "vocab_size", "hidden_layers", "pipelined", "hidden_planes", "hidden_shm", "hidden_size", "hidden_plane_dtype", "lanes")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_PLANES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_PLANE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    model: str
    vocab_size: int
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    pipelined: bool
    hidden_planes: _containers.RepeatedScalarFieldContainer[str]
    hidden_shm: str
    hidden_size: int
    hidden_plane_dtype: str
    lanes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target_id: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., pipelined: _Optional[bool] = ..., hidden_planes: _Optional[_Iterable[str]] = ..., hidden_shm: _Optional[str] = ..., hidden_size: _Optional[int] = ..., hidden_plane_dtype: _Optional[str] = ..., lanes: _Optional[_Iterable[str]] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("draft_id", "method", "hidden_layers", "max_num_speculative_tokens", "hidden_dtype", "vocab_size", "pipelined", "hidden_plane", "step_news", "lane", "lane_address", "lane_token", "incarnation", "lora")
    DRAFT_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_PLANE_FIELD_NUMBER: _ClassVar[int]
    STEP_NEWS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LANE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    draft_id: str
    method: str
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    max_num_speculative_tokens: int
    hidden_dtype: str
    vocab_size: int
    pipelined: bool
    hidden_plane: str
    step_news: bool
    lane: str
    lane_address: str
    lane_token: bytes
    incarnation: int
    lora: str
    def __init__(self, draft_id: _Optional[str] = ..., method: _Optional[str] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., max_num_speculative_tokens: _Optional[int] = ..., hidden_dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., pipelined: _Optional[bool] = ..., hidden_plane: _Optional[str] = ..., step_news: _Optional[bool] = ..., lane: _Optional[str] = ..., lane_address: _Optional[str] = ..., lane_token: _Optional[bytes] = ..., incarnation: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class SamplingSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("seq_id", "round", "new_tokens", "num_speculative_tokens", "sampling", "hidden_states", "tree_topk", "tree_depth", "max_depth", "hidden")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TREE_TOPK_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    round: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    sampling: SamplingSpec
    hidden_states: _containers.RepeatedCompositeFieldContainer[Tensor]
    tree_topk: int
    tree_depth: int
    max_depth: int
    hidden: HiddenRef
    def __init__(self, seq_id: _Optional[str] = ..., round: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingSpec, _Mapping]] = ..., hidden_states: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., tree_topk: _Optional[int] = ..., tree_depth: _Optional[int] = ..., max_depth: _Optional[int] = ..., hidden: _Optional[_Union[HiddenRef, _Mapping]] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "round", "token_ids", "distributions", "parents", "start", "assumed", "confidence")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    round: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    parents: _containers.RepeatedScalarFieldContainer[int]
    start: int
    assumed: _containers.RepeatedScalarFieldContainer[int]
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[str] = ..., round: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., assumed: _Optional[_Iterable[int]] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposalBatch(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("seq_id", "round", "num_accepted", "emitted_tokens", "hidden_states", "hidden")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    round: int
    num_accepted: int
    emitted_tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: _containers.RepeatedCompositeFieldContainer[Tensor]
    hidden: HiddenRef
    def __init__(self, seq_id: _Optional[str] = ..., round: _Optional[int] = ..., num_accepted: _Optional[int] = ..., emitted_tokens: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., hidden: _Optional[_Union[HiddenRef, _Mapping]] = ...) -> None: ...

class HiddenRef(_message.Message):
    __slots__ = ("offset", "count", "streamed")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    count: int
    streamed: bool
    def __init__(self, offset: _Optional[int] = ..., count: _Optional[int] = ..., streamed: _Optional[bool] = ...) -> None: ...

class HiddenRows(_message.Message):
    __slots__ = ("offset", "rows", "at", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    rows: int
    at: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., rows: _Optional[int] = ..., at: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ...) -> None: ...

class StepNews(_message.Message):
    __slots__ = ("verify", "release", "propose")
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    verify: VerifyBatch
    release: ReleaseBatch
    propose: ProposeBatch
    def __init__(self, verify: _Optional[_Union[VerifyBatch, _Mapping]] = ..., release: _Optional[_Union[ReleaseBatch, _Mapping]] = ..., propose: _Optional[_Union[ProposeBatch, _Mapping]] = ...) -> None: ...

class ReleaseBatch(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...
