"""Every numeric code that travels on the wire, in one place.

The values are the protocol: never renumber one, only add. A decoder refuses a value it
does not know (RemoteProtocolError) rather than guessing; new values come with a new
protocol version negotiated in HELLO.
"""

from __future__ import annotations

import enum


class Command(enum.IntEnum):
    """Frame command codes (u8). A response is its request's code with the high bit set."""

    HELLO = 0x01
    SEND_BATCH = 0x02
    PULL = 0x03
    COMMIT_OFFSET = 0x04
    JOIN_GROUP = 0x05
    HEARTBEAT = 0x06
    QUERY = 0x07
    STATS = 0x08
    CANCEL = 0x09  # withdraw a pending message (docs/cancel.md)
    RESCHEDULE = 0x0A  # move a pending message to another due time (docs/cancel.md)
    CANCEL_BATCH = 0x0B  # many CANCELs in one frame (throughput)
    HELD_IDS = 0x0C  # which ids the delay server holds, read-only (protocol version 3)

    HELLO_OK = 0x81
    SEND_BATCH_RESULT = 0x82
    PULL_RESULT = 0x83
    COMMIT_OFFSET_OK = 0x84
    JOIN_GROUP_RESULT = 0x85
    HEARTBEAT_RESULT = 0x86
    QUERY_RESULT = 0x87
    STATS_RESULT = 0x88
    CANCEL_RESULT = 0x89
    RESCHEDULE_RESULT = 0x8A
    CANCEL_BATCH_RESULT = 0x8B
    HELD_IDS_RESULT = 0x8C

    ERROR = 0xFF  # answers any request, or none (request id 0: the whole connection)

    @property
    def is_request(self) -> bool:
        return self < 0x80


RESPONSE_TO: dict[Command, Command] = {c: Command(c | 0x80) for c in Command if c < 0x80}


class ErrorCode(enum.IntEnum):
    """The code of an ERROR frame (u16): why a request, or the connection, failed."""

    MALFORMED = 1  # a frame or body that does not follow the grammar (bad CRC, overrun...)
    UNSUPPORTED_VERSION = 2  # no protocol version in common, or an unknown frame version
    UNAUTHORIZED = 3  # HELLO without the server's token, or with a wrong one
    HELLO_REQUIRED = 4  # a command other than HELLO before a successful HELLO
    FRAME_TOO_LARGE = 5  # a header announcing more than the receiver's max_frame_size
    UNKNOWN_COMMAND = 6  # a command code this side does not know
    INVALID_REQUEST = 7  # well-formed but unacceptable (bad group name, max_messages 0...)
    BUSY = 8  # overloaded: retry later, with back-off
    UNSUPPORTED = 9  # a known command this server does not implement (yet)
    SHUTTING_DOWN = 10  # the server is stopping: retry on another node
    INTERNAL = 11  # a bug or an I/O failure on the server
    DISK_FULL = 12  # the server's disk is full: nothing was stored; retry later
    TOO_MANY_CONNECTIONS = 14  # the server holds its max_connections: connect again later
    TIMEOUT = 15  # HELLO, or a started frame, not finished within the server's deadline
    NOT_LEADER = 16  # a group member that does not lead: the reason names the leader

    @property
    def is_retryable(self) -> bool:
        """Whether sending the same request again (later, or elsewhere) may succeed."""
        return self in (
            ErrorCode.BUSY,
            ErrorCode.SHUTTING_DOWN,
            ErrorCode.DISK_FULL,
            ErrorCode.TOO_MANY_CONNECTIONS,
        )


class ResultCode(enum.IntEnum):
    """The outcome of one message of a SEND_BATCH (u8)."""

    OK = 0  # stored durably
    DUPLICATE = 1  # a message with this id is already stored; counts as success
    INVALID_SUBJECT = 2  # see validate_subject
    EMPTY_ID = 3  # message_id is ""
    BODY_TOO_LARGE = 4  # body over the server's max_body_size
    PROPERTIES_TOO_LARGE = 5  # properties over the server's limit
    DELAY_TOO_LONG = 6  # due beyond now + max_delay (QMQ clamps silently; we refuse)
    INVALID_DELAY = 7  # both at_ms and delay_ms set, or a negative delay_ms
    BUSY = 8  # not stored because the server is overloaded: retry later
    INTERNAL = 9  # not stored because of a server-side failure
    INVALID_ID = 10  # message_id is not printable text (a NUL, newline, control character)
    DISK_FULL = 11  # not stored because the server's disk is full: retry later

    @property
    def is_success(self) -> bool:
        """Whether the message is stored (OK or DUPLICATE): the producer may forget it."""
        return self in (ResultCode.OK, ResultCode.DUPLICATE)

    @property
    def is_retryable(self) -> bool:
        """Whether sending the same message again later may succeed."""
        return self in (ResultCode.BUSY, ResultCode.DISK_FULL)


class CancelOutcome(enum.IntEnum):
    """The answer to CANCEL, and to each id of CANCEL_BATCH (u8); docs/cancel.md says
    which a cancel gets when its message is in flight to a broker."""

    CANCELLED = 0  # will not be delivered
    ALREADY_DELIVERED = 1  # too late: handed to a broker at dispatched_ms
    UNKNOWN = 2  # no pending or delivered message with this id


class RescheduleOutcome(enum.IntEnum):
    """The answer to RESCHEDULE (u8); docs/cancel.md, as CancelOutcome."""

    RESCHEDULED = 0  # now due at the requested time
    ALREADY_DELIVERED = 1  # too late: handed to a broker at dispatched_ms
    UNKNOWN = 2  # no pending message with this id (never sent, or cancelled)
    DELAY_TOO_LONG = 3  # the new time is beyond now + max_delay
