package pglock

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A release that hands a lease to a waiter notifies pgfence_lock_handoff with
// "wkey wait_id token expiry_us left_us tag" (migration 00010): left_us is
// what is left of the lease on the server's clock when the payload was made;
// tag is the hex of sha256(k || sha256(k || m || " " || name)), m the payload
// before the tag and name the lock's (migration 00029: a handoff of another
// name's lease does not check), where k is the waiter's handoff key,
// sha256(secret || sha256(lease key)),
// and the secret is a row of pgfence.handoff_secret that no role but the
// schema's owner reads. A Locker reads its k once (pgfence.lock_handoff_key,
// which needs the lease key itself) and takes a payload whose tag checks as
// the lease, with no statement; any other wake-up is checked in the database
// (handed).

// handoffKeyRetry is how long a Locker whose handoff key could not be read
// waits before it tries again (meanwhile every handoff is read).
const handoffKeyRetry = time.Minute

// handoffKey returns the Locker's handoff key, reading it on first use; nil
// if it cannot be had now (the payloads are then checked in the database).
func (l *Locker) handoffKey(ctx context.Context) []byte {
	l.hkMu.Lock()
	k, retry := l.hk, l.hkRetry
	l.hkMu.Unlock()
	if k != nil || time.Now().Before(retry) {
		return k
	}
	err := l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		k, err = l.q.HandoffKey(ctx, conn, l.key)
		return err
	})
	l.hkMu.Lock()
	defer l.hkMu.Unlock()
	if err != nil || len(k) != sha256.Size {
		if ctx.Err() == nil {
			// Not migrated to version 10, or the role lacks EXECUTE on
			// pgfence.lock_handoff_key (docs/migrations.md).
			l.hkRetry = time.Now().Add(handoffKeyRetry)
			l.log.Warn("pglock: reading the handoff key failed; each handed lease is read from the database meanwhile",
				"err", err, "retry_in", handoffKeyRetry)
		}
		return nil
	}
	l.hk = k
	return k
}

// taggedHandoff returns the lease a handoff notification's payload hands to
// wait w, if its tag checks with the Locker's handoff key; nil otherwise
// (no payload, a forged or stale one, or no key).
//
// The lease's local deadline is queuedAt + left_us. queuedAt is taken before
// the wait's first QueueGrant was sent, and the release made the payload
// after it saw the wait queued, so the moment left_us was measured comes
// after queuedAt on any clock: the deadline passes before the lease ends.
// (The expiry itself counts from the start of the release's transaction,
// which may precede queuedAt: queuedAt + TTL would not be safe.) A deadline
// less than half the TTL away is not used: the read (handed) counts from the
// database's answer instead, which loses less.
func (l *Locker) taggedHandoff(ctx context.Context, name string, ttl time.Duration, w *waiter, queuedAt time.Time) *Lease {
	payload, ok := w.hsub.Payload()
	if !ok || strings.Count(payload, " ") != 5 {
		return nil
	}
	k := l.handoffKey(ctx)
	if k == nil {
		return nil
	}
	token, expiryUs, leftUs, ok := checkHandoff(payload, name, w.wkey, w.waitID, k)
	if !ok {
		return nil
	}
	deadline := queuedAt.Add(time.Duration(leftUs) * time.Microsecond)
	if time.Until(deadline) < ttl/2 {
		return nil
	}
	return l.newLease(name, token, ttl, time.UnixMicro(expiryUs), deadline.Add(-ttl))
}

// checkHandoff parses a handoff payload "wkey wait_id token expiry_us
// left_us tag" and reports whether it is for the wait (wkey, waitID) and its
// tag checks with the handoff key k for a lease of name.
func checkHandoff(payload, name string, wkey, waitID int64, k []byte) (token, expiryUs, leftUs int64, ok bool) {
	i := strings.LastIndexByte(payload, ' ')
	if i < 0 {
		return 0, 0, 0, false
	}
	msg, tagHex := payload[:i], payload[i+1:]
	f := strings.Split(msg, " ")
	if len(f) != 5 || f[0] != strconv.FormatInt(wkey, 10) || f[1] != strconv.FormatInt(waitID, 10) {
		return 0, 0, 0, false
	}
	tag, err := hex.DecodeString(tagHex)
	if err != nil || len(tag) != sha256.Size {
		return 0, 0, 0, false
	}
	if subtle.ConstantTimeCompare(tag, handoffTag(k, msg+" "+name)) != 1 {
		return 0, 0, 0, false
	}
	token, err1 := strconv.ParseInt(f[2], 10, 64)
	expiryUs, err2 := strconv.ParseInt(f[3], 10, 64)
	leftUs, err3 := strconv.ParseInt(f[4], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || token <= 0 || leftUs <= 0 {
		return 0, 0, 0, false
	}
	return token, expiryUs, leftUs, true
}

// handoffTag is sha256(k || sha256(k || msg)); msg is a payload's text
// before its tag, a space and the lock's name.
func handoffTag(k []byte, msg string) []byte {
	h := sha256.New()
	h.Write(k)
	h.Write([]byte(msg))
	inner := h.Sum(nil)
	h.Reset()
	h.Write(k)
	h.Write(inner)
	return h.Sum(nil)
}
