from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Request(_message.Message):
    __slots__ = ("command",)
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: str
    def __init__(self, command: _Optional[str] = ...) -> None: ...

class Response(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Address(_message.Message):
    __slots__ = ("twin", "connection")
    TWIN_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    twin: int
    connection: str
    def __init__(self, twin: _Optional[int] = ..., connection: _Optional[str] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Pong(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("uid", "tags", "timestamp", "expiration", "source", "destination", "request", "response", "error", "ping", "pong", "signature", "schema", "federation", "plain", "cipher", "relays")
    UID_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    FEDERATION_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    CIPHER_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    tags: str
    timestamp: int
    expiration: int
    source: Address
    destination: Address
    request: Request
    response: Response
    error: Error
    ping: Ping
    pong: Pong
    signature: bytes
    schema: str
    federation: str
    plain: bytes
    cipher: bytes
    relays: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, uid: _Optional[str] = ..., tags: _Optional[str] = ..., timestamp: _Optional[int] = ..., expiration: _Optional[int] = ..., source: _Optional[_Union[Address, _Mapping]] = ..., destination: _Optional[_Union[Address, _Mapping]] = ..., request: _Optional[_Union[Request, _Mapping]] = ..., response: _Optional[_Union[Response, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., signature: _Optional[bytes] = ..., schema: _Optional[str] = ..., federation: _Optional[str] = ..., plain: _Optional[bytes] = ..., cipher: _Optional[bytes] = ..., relays: _Optional[_Iterable[str]] = ...) -> None: ...
