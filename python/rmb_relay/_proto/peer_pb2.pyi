from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Backlog(_message.Message):
    __slots__ = ("uid", "reference", "reply_to", "module", "ttl")
    UID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    uid: str
    reference: str
    reply_to: str
    module: str
    ttl: int
    def __init__(self, uid: _Optional[str] = ..., reference: _Optional[str] = ..., reply_to: _Optional[str] = ..., module: _Optional[str] = ..., ttl: _Optional[int] = ...) -> None: ...
