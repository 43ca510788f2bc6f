from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Side(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLD: _ClassVar[Side]
    BUY: _ClassVar[Side]
    SELL: _ClassVar[Side]
HOLD: Side
BUY: Side
SELL: Side

class BookLevel(_message.Message):
    __slots__ = ("bid_price", "bid_size", "ask_price", "ask_size")
    BID_PRICE_FIELD_NUMBER: _ClassVar[int]
    BID_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASK_PRICE_FIELD_NUMBER: _ClassVar[int]
    ASK_SIZE_FIELD_NUMBER: _ClassVar[int]
    bid_price: float
    bid_size: float
    ask_price: float
    ask_size: float
    def __init__(self, bid_price: _Optional[float] = ..., bid_size: _Optional[float] = ..., ask_price: _Optional[float] = ..., ask_size: _Optional[float] = ...) -> None: ...

class Tick(_message.Message):
    __slots__ = ("ts_ns", "price", "size")
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ts_ns: int
    price: float
    size: float
    def __init__(self, ts_ns: _Optional[int] = ..., price: _Optional[float] = ..., size: _Optional[float] = ...) -> None: ...

class MarketSnapshot(_message.Message):
    __slots__ = ("sequence_id", "symbol", "levels", "ticks", "ts_ns", "position")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    TICKS_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    symbol: str
    levels: _containers.RepeatedCompositeFieldContainer[BookLevel]
    ticks: _containers.RepeatedCompositeFieldContainer[Tick]
    ts_ns: int
    position: float
    def __init__(self, sequence_id: _Optional[int] = ..., symbol: _Optional[str] = ..., levels: _Optional[_Iterable[_Union[BookLevel, _Mapping]]] = ..., ticks: _Optional[_Iterable[_Union[Tick, _Mapping]]] = ..., ts_ns: _Optional[int] = ..., position: _Optional[float] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage", "ns")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    ns: int
    def __init__(self, stage: _Optional[str] = ..., ns: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("sequence_id", "symbol", "side", "price", "size", "confidence", "tier", "reason", "stages", "server_latency_ns", "batch_size", "cache")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SERVER_LATENCY_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    symbol: str
    side: Side
    price: float
    size: float
    confidence: float
    tier: str
    reason: str
    stages: _containers.RepeatedCompositeFieldContainer[StageTiming]
    server_latency_ns: int
    batch_size: int
    cache: str
    def __init__(self, sequence_id: _Optional[int] = ..., symbol: _Optional[str] = ..., side: _Optional[_Union[Side, str]] = ..., price: _Optional[float] = ..., size: _Optional[float] = ..., confidence: _Optional[float] = ..., tier: _Optional[str] = ..., reason: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., server_latency_ns: _Optional[int] = ..., batch_size: _Optional[int] = ..., cache: _Optional[str] = ...) -> None: ...
