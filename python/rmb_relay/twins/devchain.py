"""`rmb-relay devchain`: a local chain node for developing against RMB offline.

It speaks the part of substrate's JSON-RPC (websocket, and HTTP POST) that rmb-relay, rmb-peer
and standard substrate clients use for twins: metadata and runtime version, block hashes and
headers, `state_getStorage`/`state_queryStorageAt` of tfchain's own storage keys with tfchain's
SCALE encoding, new-head, finalized-head and storage subscriptions, and
`author_submitAndWatchExtrinsic` for `TfgridModule.update_twin` and `create_twin` (signature,
nonce and arguments checked as the chain does). The runtime metadata is the one shipped in the
package, so what this node says decodes exactly as tfchain's answers do.

What it is not: a blockchain. There is no consensus, no fees and no history of storage: every
read sees the latest twins (only `System.Events` is kept per block, because the event listener
catches up on old blocks). A block is made for each accepted extrinsic and every `block_time`
seconds (empty), and is final at once.

Twins live in a file of the embedded directory's format (`twins/local.py`), read on every
query: `rmb-relay twins add --twins sqlite:FILE` edits it directly (no event is emitted for
that; caches catch up at their TTL), `rmb-relay twins add --devchain URL` goes through the
node (`devchain_putTwin`, a dev-only method), which emits `TwinStored` like the chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web

from rmb_relay import __version__
from rmb_relay.errors import ConfigError, RelayError
from rmb_relay.twins import MAX_TWIN_ID, PK_LEN, Twin, parse_relays
from rmb_relay.twins.chain import PALLET, ChainCodec, ChainDataError, SignedExtrinsic
from rmb_relay.twins.local import SqliteTwinDirectory

__all__ = ["DEFAULT_BLOCK_TIME", "DevChain", "JsonRpcError"]

log = logging.getLogger("rmb_relay.devchain")

#: seconds between empty blocks (tfchain's block time); the relay's event listener treats a
#: node without a new head for 7 s as stalled
DEFAULT_BLOCK_TIME = 6.0
#: substrate's "Invalid Transaction" error code (author_submit*)
INVALID_TRANSACTION = 1010
_INVALID = "Invalid Transaction"
#: JSON-RPC codes
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
PARSE_ERROR = -32700
#: the ExtrinsicSuccess/ExtrinsicFailed dispatch info (weights are not modelled)
_DISPATCH_INFO = {"weight": {"ref_time": 0, "proof_size": 0}, "class": "Normal", "pays_fee": "Yes"}
#: TfgridModule error indexes used in ExtrinsicFailed (pallet_tfgrid Error enum order)
_ERR_TWIN_NOT_EXISTS = 11
_ERR_TWIN_EXISTS = 9


class JsonRpcError(RelayError):
    def __init__(self, code: int, message: str, data: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def as_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@dataclass(frozen=True, slots=True)
class Block:
    number: int
    hash: bytes
    parent: bytes
    extrinsics: tuple[bytes, ...]
    #: the block's `System.Events` value (None: no events)
    events: bytes | None

    def header(self) -> dict[str, Any]:
        return {
            "parentHash": _hex(self.parent),
            "number": hex(self.number),
            "stateRoot": _hex(hashlib.blake2b(self.hash + b"state", digest_size=32).digest()),
            "extrinsicsRoot": _hex(hashlib.blake2b(b"".join(self.extrinsics)).digest()[:32]),
            "digest": {"logs": []},
        }


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


def _unhex(value: object, what: str) -> bytes:
    if not isinstance(value, str) or not value.startswith("0x"):
        raise JsonRpcError(INVALID_PARAMS, f"{what} must be a 0x-hex string")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise JsonRpcError(INVALID_PARAMS, f"{what} is not hex") from None


Notify = Callable[[str, str, Any], None]


class Session:
    """One client connection's subscriptions."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self.send = send
        #: subscription id -> kind ("newHead", "finalizedHead", "allHead", "storage", "extrinsic")
        self.subscriptions: dict[str, str] = {}
        #: storage subscription id -> {key: last value sent}
        self.storage: dict[str, dict[bytes, bytes | None]] = {}

    def notify(self, method: str, sub_id: str, result: Any) -> None:
        self.send(
            {
                "jsonrpc": "2.0",
                "method": method,
                "params": {"subscription": sub_id, "result": result},
            }
        )


_HEAD_METHODS = {
    "chain_subscribeNewHeads": ("newHead", "chain_newHead"),
    "chain_subscribeNewHead": ("newHead", "chain_newHead"),
    "subscribe_newHead": ("newHead", "chain_newHead"),
    "chain_subscribeAllHeads": ("allHead", "chain_allHead"),
    "chain_subscribeFinalizedHeads": ("finalizedHead", "chain_finalizedHead"),
    "chain_subscribeFinalisedHeads": ("finalizedHead", "chain_finalizedHead"),
}
_NOTIFY_METHOD = {kind: method for kind, method in _HEAD_METHODS.values()}
_UNSUBSCRIBE = {
    "chain_unsubscribeNewHeads",
    "chain_unsubscribeNewHead",
    "unsubscribe_newHead",
    "chain_unsubscribeAllHeads",
    "chain_unsubscribeFinalizedHeads",
    "chain_unsubscribeFinalisedHeads",
    "state_unsubscribeStorage",
    "author_unwatchExtrinsic",
}


class DevChain:
    """The node's state and JSON-RPC methods; `app()` serves them (see the module docstring)."""

    def __init__(
        self, codec: ChainCodec, twins: SqliteTwinDirectory, *, block_time: float = 6.0
    ) -> None:
        if not block_time > 0:
            raise ConfigError("--block-time must be a positive number of seconds")
        self.codec = codec
        self.twins = twins
        self.block_time = block_time
        genesis = hashlib.blake2b(b"rmb-relay devchain genesis", digest_size=32).digest()
        self.blocks: list[Block] = [Block(0, genesis, b"\0" * 32, (), None)]
        self._by_hash = {genesis: self.blocks[0]}
        self.nonces: dict[bytes, int] = {}
        self.sessions: set[Session] = set()
        self._sockets: set[web.WebSocketResponse] = set()
        self._ids = itertools.count(1)
        self._ticker: asyncio.Task[None] | None = None

    @property
    def genesis(self) -> bytes:
        return self.blocks[0].hash

    @property
    def best(self) -> Block:
        return self.blocks[-1]

    # ---- blocks ----------------------------------------------------------------------------

    def produce(self, extrinsics: tuple[bytes, ...] = (), events: bytes | None = None) -> Block:
        """Seal a block on top of the best one, final at once, and tell the subscribers."""
        parent = self.best
        number = parent.number + 1
        digest = hashlib.blake2b(digest_size=32)
        digest.update(parent.hash + number.to_bytes(4, "little"))
        for extrinsic in extrinsics:
            digest.update(extrinsic)
        block = Block(number, digest.digest(), parent.hash, extrinsics, events)
        self.blocks.append(block)
        self._by_hash[block.hash] = block
        header = block.header()
        for session in list(self.sessions):
            for sub_id, kind in list(session.subscriptions.items()):
                if kind in _NOTIFY_METHOD:
                    session.notify(_NOTIFY_METHOD[kind], sub_id, header)
                elif kind == "storage":
                    self._notify_storage(session, sub_id, block)
        return block

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.block_time)
            self.produce()

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="devchain-blocks")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        # clients keep their websocket open; the server's shutdown would wait for each
        await asyncio.gather(
            *(ws.close(code=1001, message=b"devchain stopping") for ws in list(self._sockets)),
            return_exceptions=True,
        )
        await self.twins.close()

    def _block(self, value: object) -> Block:
        """A block by hash param (None: the best)."""
        if value is None:
            return self.best
        block = self._by_hash.get(_unhex(value, "block hash"))
        if block is None:
            raise JsonRpcError(4003, f"unknown block {value}")
        return block

    # ---- storage ---------------------------------------------------------------------------

    def storage(self, key: bytes, block: Block) -> bytes | None:
        parsed = self.codec.parse_key(key)
        if parsed is None:
            return None
        if parsed.kind == "events":
            return block.events
        if parsed.kind == "twin":
            assert isinstance(parsed.key, int)
            twin = self.twins.show(parsed.key) if 0 < parsed.key <= MAX_TWIN_ID else None
            return None if twin is None else self.codec.encode_twin(twin)
        assert isinstance(parsed.key, bytes)
        found = self.twins.find_account(parsed.key)
        return None if found is None else self.codec.encode_twin_id(found.id)

    def _notify_storage(self, session: Session, sub_id: str, block: Block) -> None:
        last = session.storage.get(sub_id, {})
        changes = []
        for key, before in last.items():
            now = self.storage(key, block)
            if now != before:
                last[key] = now
                changes.append([_hex(key), None if now is None else _hex(now)])
        if changes:
            session.notify("state_storage", sub_id, {"block": _hex(block.hash), "changes": changes})

    # ---- extrinsics ------------------------------------------------------------------------

    def validate(self, data: bytes) -> SignedExtrinsic:
        """Decode and check an extrinsic as the chain's transaction pool would."""
        try:
            extrinsic = self.codec.decode_extrinsic(data)
        except ChainDataError as err:
            raise JsonRpcError(INVALID_TRANSACTION, "Invalid Transaction", str(err)) from None
        if extrinsic.function not in ("update_twin", "create_twin"):
            raise JsonRpcError(
                INVALID_TRANSACTION,
                "Invalid Transaction",
                f"the devchain runs {PALLET}.update_twin and create_twin only",
            )
        if not self.codec.verify(extrinsic, self.genesis):
            raise JsonRpcError(
                INVALID_TRANSACTION, "Invalid Transaction", "Transaction has a bad signature"
            )
        expected = self.nonces.get(extrinsic.account, 0)
        if extrinsic.nonce < expected:
            raise JsonRpcError(INVALID_TRANSACTION, _INVALID, "Transaction is outdated")
        if extrinsic.nonce > expected:
            raise JsonRpcError(INVALID_TRANSACTION, _INVALID, "Transaction is in the future")
        return extrinsic

    def apply(self, data: bytes, extrinsic: SignedExtrinsic) -> Block:
        """Run a validated extrinsic in a new block: the twin change and its event on success,
        ExtrinsicFailed (with the pallet's error) otherwise."""
        self.nonces[extrinsic.account] = extrinsic.nonce + 1
        events: list[tuple[int, str, str, Any]] = []
        error: int | None = None
        try:
            relay, pk = _twin_args(extrinsic.args)
        except ConfigError as err:
            log.info("devchain: %s failed: %s", extrinsic.function, err)
            relay, pk, error = None, None, 0
        existing = self.twins.find_account(extrinsic.account)
        if error is None and extrinsic.function == "update_twin":
            if existing is None:
                error = _ERR_TWIN_NOT_EXISTS
            else:
                twin = Twin(existing.id, existing.account, relay, pk)
                self.twins.add(twin)
                events.append((0, PALLET, "TwinUpdated", self.codec.twin_value(twin)))
        elif error is None:  # create_twin
            if existing is not None:
                error = _ERR_TWIN_EXISTS
            else:
                new_id = max((t.id for t in self.twins.list()), default=0) + 1
                twin = Twin(new_id, extrinsic.account, relay, pk)
                self.twins.add(twin)
                events.append((0, PALLET, "TwinStored", self.codec.twin_value(twin)))
        if error is None:
            events.append((0, "System", "ExtrinsicSuccess", {"dispatch_info": _DISPATCH_INFO}))
        else:
            module_error = {"index": 25, "error": "0x" + bytes([error, 0, 0, 0]).hex()}
            events.append(
                (
                    0,
                    "System",
                    "ExtrinsicFailed",
                    {"dispatch_error": {"Module": module_error}, "dispatch_info": _DISPATCH_INFO},
                )
            )
        return self.produce((data,), self.codec.encode_events(events))

    def put_twin(self, twin: Twin) -> Block:
        """The dev-only `devchain_putTwin`: store a twin as given, with a TwinStored event."""
        self.twins.add(twin)
        events = [(0, PALLET, "TwinStored", self.codec.twin_value(twin))]
        return self.produce((), self.codec.encode_events(events))

    # ---- JSON-RPC --------------------------------------------------------------------------

    def handle(self, session: Session, request: Any) -> dict[str, Any] | None:
        """One JSON-RPC request -> its answer (None for a notification without id)."""
        if not isinstance(request, dict) or not isinstance(request.get("method"), str):
            return _error(None, JsonRpcError(-32600, "Invalid Request"))
        request_id = request.get("id")
        params = request.get("params") or []
        if not isinstance(params, list):
            return _error(request_id, JsonRpcError(INVALID_PARAMS, "params must be a list"))
        try:
            result = self.call(session, request["method"], params, request_id)
        except JsonRpcError as err:
            return _error(request_id, err)
        except Exception as err:  # a bad param shape we did not foresee: the caller's fault
            log.warning("devchain: %s failed: %r", request["method"], err)
            return _error(request_id, JsonRpcError(INVALID_PARAMS, f"invalid params: {err}"))
        return {"jsonrpc": "2.0", "id": request_id, "result": result}

    def call(self, session: Session, method: str, params: list[Any], request_id: Any) -> Any:
        param = params[0] if params else None
        if method == "rpc_methods":
            return {"version": 1, "methods": sorted(_METHODS)}
        if method == "system_name":
            return "rmb-relay devchain"
        if method == "system_version":
            return __version__
        if method == "system_chain":
            return "rmb-relay devchain"
        if method == "system_chainType":
            return "Development"
        if method == "system_properties":
            return {"ss58Format": 42, "tokenDecimals": 7, "tokenSymbol": "TFT"}
        if method == "system_health":
            return {"peers": 0, "isSyncing": False, "shouldHavePeers": False}
        if method == "system_accountNextIndex":
            return self.nonces.get(_account(param), 0)
        if method in ("chain_getBlockHash", "chain_getHead"):
            if param is None:
                return _hex(self.best.hash)
            number = int(param, 16) if isinstance(param, str) else param
            if not isinstance(number, int) or number < 0:
                raise JsonRpcError(INVALID_PARAMS, "block number must be a non-negative integer")
            return _hex(self.blocks[number].hash) if number < len(self.blocks) else None
        if method in ("chain_getFinalizedHead", "chain_getFinalisedHead"):
            return _hex(self.best.hash)
        if method == "chain_getHeader":
            return self._block(param).header()
        if method == "chain_getBlock":
            block = self._block(param)
            extrinsics = [_hex(e) for e in block.extrinsics]
            return {"block": {"header": block.header(), "extrinsics": extrinsics}}
        if method in ("state_getRuntimeVersion", "chain_getRuntimeVersion"):
            return self.codec.runtime_version
        if method == "state_getMetadata":
            return _hex(self.codec.metadata_bytes)
        if method in ("state_getStorage", "state_getStorageAt"):
            block = self._block(params[1] if len(params) > 1 else None)
            value = self.storage(_unhex(param, "storage key"), block)
            return None if value is None else _hex(value)
        if method == "state_queryStorageAt":
            if not isinstance(param, list):
                raise JsonRpcError(INVALID_PARAMS, "state_queryStorageAt takes a list of keys")
            block = self._block(params[1] if len(params) > 1 else None)
            changes = []
            for key in param:
                value = self.storage(_unhex(key, "storage key"), block)
                changes.append([key, None if value is None else _hex(value)])
            return [{"block": _hex(block.hash), "changes": changes}]
        if method in _HEAD_METHODS:
            kind, notify = _HEAD_METHODS[method]
            sub_id = self._subscribe(session, kind)
            header = self.best.header()
            asyncio.get_running_loop().call_soon(session.notify, notify, sub_id, header)
            return sub_id
        if method == "state_subscribeStorage":
            if not isinstance(param, list):
                raise JsonRpcError(INVALID_PARAMS, "state_subscribeStorage takes a list of keys")
            keys = [_unhex(key, "storage key") for key in param]
            sub_id = self._subscribe(session, "storage")
            session.storage[sub_id] = dict.fromkeys(keys, b"\xff-unset")
            asyncio.get_running_loop().call_soon(self._notify_storage, session, sub_id, self.best)
            return sub_id
        if method in _UNSUBSCRIBE:
            found = session.subscriptions.pop(str(param), None) is not None
            session.storage.pop(str(param), None)
            return found
        if method == "author_submitExtrinsic":
            data = _unhex(param, "extrinsic")
            extrinsic = self.validate(data)
            self.apply(data, extrinsic)
            return _hex(extrinsic.hash)
        if method == "author_submitAndWatchExtrinsic":
            data = _unhex(param, "extrinsic")
            extrinsic = self.validate(data)
            sub_id = self._subscribe(session, "extrinsic")
            asyncio.get_running_loop().call_soon(self._include, session, sub_id, data, extrinsic)
            return sub_id
        if method == "devchain_putTwin":
            return _hex(self.put_twin(_twin_from_json(param)).hash)
        raise JsonRpcError(METHOD_NOT_FOUND, f"Method not found: {method}")

    def _subscribe(self, session: Session, kind: str) -> str:
        sub_id = f"{next(self._ids):016x}"
        session.subscriptions[sub_id] = kind
        return sub_id

    def _include(
        self, session: Session, sub_id: str, data: bytes, extrinsic: SignedExtrinsic
    ) -> None:
        """After the subscribe answer: ready, then the block it went into, then final."""
        session.notify("author_extrinsicUpdate", sub_id, "ready")
        block = self.apply(data, extrinsic)
        if sub_id in session.subscriptions:
            session.notify("author_extrinsicUpdate", sub_id, {"inBlock": _hex(block.hash)})
            session.notify("author_extrinsicUpdate", sub_id, {"finalized": _hex(block.hash)})
            session.subscriptions.pop(sub_id, None)

    # ---- serving ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._websocket)
        app.router.add_post("/", self._http)
        return app

    async def _http(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response(_error(None, JsonRpcError(PARSE_ERROR, "Parse error")))
        session = Session(lambda _message: None)
        if isinstance(body, list):
            return web.json_response([self.handle(session, item) for item in body])
        return web.json_response(self.handle(session, body))

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=16 << 20)
        if not ws.can_prepare(request).ok:
            return web.Response(text="rmb-relay devchain: substrate JSON-RPC over websocket\n")
        await ws.prepare(request)
        self._sockets.add(ws)
        outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        session = Session(outbox.put_nowait)
        self.sessions.add(session)

        async def writer() -> None:
            while (message := await outbox.get()) is not None:
                await ws.send_str(json.dumps(message, separators=(",", ":")))

        writing = asyncio.get_running_loop().create_task(writer())
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    continue
                try:
                    body = json.loads(message.data)
                except ValueError:
                    outbox.put_nowait(_error(None, JsonRpcError(PARSE_ERROR, "Parse error")))
                    continue
                answer = self.handle(session, body)
                if answer is not None:
                    outbox.put_nowait(answer)
        finally:
            self.sessions.discard(session)
            self._sockets.discard(ws)
            outbox.put_nowait(None)
            await asyncio.gather(writing, return_exceptions=True)
        return ws


_METHODS = {
    "rpc_methods",
    "system_name",
    "system_version",
    "system_chain",
    "system_chainType",
    "system_properties",
    "system_health",
    "system_accountNextIndex",
    "chain_getBlockHash",
    "chain_getHead",
    "chain_getFinalizedHead",
    "chain_getHeader",
    "chain_getBlock",
    "state_getRuntimeVersion",
    "chain_getRuntimeVersion",
    "state_getMetadata",
    "state_getStorage",
    "state_getStorageAt",
    "state_queryStorageAt",
    "state_subscribeStorage",
    "author_submitExtrinsic",
    "author_submitAndWatchExtrinsic",
    "devchain_putTwin",
    *_HEAD_METHODS,
    *_UNSUBSCRIBE,
}


def _error(request_id: Any, err: JsonRpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": err.as_json()}


def _account(value: object) -> bytes:
    """An account as 0x-hex or SS58 text."""
    if isinstance(value, str) and value.startswith("0x"):
        account = _unhex(value, "account")
    elif isinstance(value, str):
        from scalecodec.utils.ss58 import ss58_decode

        try:
            account = bytes.fromhex(ss58_decode(value))
        except ValueError as err:
            raise JsonRpcError(INVALID_PARAMS, f"not an SS58 address: {err}") from None
    else:
        raise JsonRpcError(INVALID_PARAMS, "account must be SS58 or 0x-hex text")
    if len(account) != 32:
        raise JsonRpcError(INVALID_PARAMS, "account must be 32 bytes")
    return account


def _twin_args(args: dict[str, Any]) -> tuple[frozenset[str] | None, bytes | None]:
    """update_twin/create_twin's (relay, pk) as the pallet validates them."""
    relay, pk = args.get("relay"), args.get("pk")
    relays = None if relay is None else parse_relays(str(relay))
    key = None
    if pk is not None:
        text = str(pk)
        try:
            key = bytes.fromhex(text[2:]) if text.startswith("0x") else text.encode()
        except ValueError:
            raise ConfigError("pk is not hex") from None
        if len(key) != PK_LEN:
            raise ConfigError(f"pk must be {PK_LEN} bytes")
    return relays, key


def _twin_from_json(value: object) -> Twin:
    if not isinstance(value, dict):
        raise JsonRpcError(INVALID_PARAMS, "devchain_putTwin takes {id, account, relay, pk}")
    try:
        relay = value.get("relay")
        pk = value.get("pk")
        return Twin(
            int(value["id"]),
            _unhex(value["account"], "account"),
            None if relay is None else parse_relays(str(relay)),
            None if pk is None else _unhex(pk, "pk"),
        )
    except (KeyError, TypeError, ValueError, ConfigError) as err:
        raise JsonRpcError(INVALID_PARAMS, f"bad twin: {err}") from None
