package migrations_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
	"time"
)

// handoffTagNameVersion is migration 00029_pgfence_handoff_tag_name.sql.
const handoffTagNameVersion = 29

// TestHandoffTagName: from version 29 a handoff's tag is sha256(k ||
// sha256(k || m || ' ' || name)), m the payload before the tag and name the
// lock's, so a waiter of one name cannot take a handoff of another's lease
// for its own; before, and after the Down, it is sha256(k || sha256(k || m)).
func TestHandoffTagName(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, handoffTagNameVersion)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "LISTEN pgfence_lock_handoff"); err != nil {
		t.Fatal(err)
	}
	key := func() []byte {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		return b
	}
	tag := func(k []byte, m string) string {
		inner := sha256.Sum256(append(append([]byte{}, k...), m...))
		outer := sha256.Sum256(append(append([]byte{}, k...), inner[:]...))
		return hex.EncodeToString(outer[:])
	}
	// handoff hands name's lease to a waiter and returns the payload's
	// message and tag, and the waiter's handoff key.
	handoff := func(name string, wkey int64) (msg, got string, k []byte) {
		t.Helper()
		hkey, wkeyBytes := key(), key()
		var tok int64
		if err := conn.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'holder', 60000000, $2)`, name, hkey).Scan(&tok); err != nil || tok <= 0 {
			t.Fatalf("grant of %s: %d, %v", name, tok, err)
		}
		var granted bool
		if err := conn.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'waiter', 60000000, $2, $3, 1)`,
			name, wkeyBytes, wkey).Scan(&granted); err != nil || granted {
			t.Fatalf("the waiter queues: granted %v, %v", granted, err)
		}
		if err := conn.QueryRow(ctx, `SELECT pgfence.lock_handoff_key($1)`, wkeyBytes).Scan(&k); err != nil || len(k) != sha256.Size {
			t.Fatalf("handoff key: %x, %v", k, err)
		}
		var handed bool
		if err := conn.QueryRow(ctx, `SELECT handed_off FROM pgfence.lock_release($1, $2, $3)`, name, tok, hkey).Scan(&handed); err != nil || !handed {
			t.Fatalf("release of %s: handed off %v, %v", name, handed, err)
		}
		n, err := conn.Conn().WaitForNotification(ctx)
		if err != nil {
			t.Fatal(err)
		}
		i := strings.LastIndexByte(n.Payload, ' ')
		if i < 0 || strings.Count(n.Payload, " ") != 5 {
			t.Fatalf("payload %q: want 'wkey wait_id token expiry_us left_us tag'", n.Payload)
		}
		return n.Payload[:i], n.Payload[i+1:], k
	}
	// Version 28: the tag covers the message alone.
	const v28 = "orders leader v28"
	if msg, got, k := handoff(v28, 2001); got != tag(k, msg) {
		t.Fatalf("version 28: tag %s, want sha256(k || sha256(k || m)) = %s", got, tag(k, msg))
	}
	if _, err := p.UpTo(ctx, handoffTagNameVersion); err != nil {
		t.Fatal(err)
	}
	const v29 = "orders leader v29"
	msg, got, k := handoff(v29, 2002)
	if want := tag(k, msg+" "+v29); got != want {
		t.Fatalf("version 29: tag %s, want sha256(k || sha256(k || m || ' ' || name)) = %s", got, want)
	}
	for _, other := range []string{"", "ORDERS LEADER V29", "orders leader v2"} {
		if other == "" {
			if got == tag(k, msg) {
				t.Fatal("version 29: the tag checks without the name")
			}
			continue
		}
		if got == tag(k, msg+" "+other) {
			t.Fatalf("version 29: the tag checks for the name %q", other)
		}
	}
	if bytes.Equal(k, make([]byte, sha256.Size)) {
		t.Fatal("a zero handoff key")
	}
	if _, err := p.DownTo(ctx, handoffTagNameVersion-1); err != nil {
		t.Fatal(err)
	}
	if msg, got, k := handoff("orders leader down", 2003); got != tag(k, msg) {
		t.Fatalf("after the Down: tag %s, want version 28's %s", got, tag(k, msg))
	}
}
