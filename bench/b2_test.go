package main

import (
	"testing"
	"time"
)

// TestHandoffSplit checks the accounting behind B2's release→grant split:
// every grant after a Release call counts in release→grant; only a grant
// after that Release returned counts in "release returned→grant", and each
// Release call counts in "release call".
func TestHandoffSplit(t *testing.T) {
	h := &handoff{epoch: time.Now().Add(-time.Second)}
	h.granted() // first grant: no release before it
	if len(h.lat) != 0 || len(h.wake) != 0 {
		t.Fatalf("a grant with no release before it was counted: lat %v wake %v", h.lat, h.wake)
	}

	// A handoff: the next grant comes after the Release returned.
	rs := h.releasing()
	h.released(rs)
	h.granted()
	if len(h.call) != 1 || len(h.lat) != 1 || len(h.wake) != 1 {
		t.Fatalf("after release, return, grant: call %d lat %d wake %d, want 1 1 1", len(h.call), len(h.lat), len(h.wake))
	}
	if h.wake[0] > h.lat[0] || h.call[0] > h.lat[0] {
		t.Fatalf("parts longer than the whole: call %v wake %v release→grant %v", h.call[0], h.wake[0], h.lat[0])
	}

	// Another client's grant before the Release returned: release→grant
	// only.
	rs = h.releasing()
	h.granted()
	h.released(rs)
	if len(h.call) != 2 || len(h.lat) != 2 || len(h.wake) != 1 {
		t.Fatalf("grant before the release returned: call %d lat %d wake %d, want 2 2 1", len(h.call), len(h.lat), len(h.wake))
	}
	// That return belongs to a release whose grant was already counted:
	// a later grant without a new release counts nowhere.
	h.granted()
	if len(h.lat) != 2 || len(h.wake) != 1 {
		t.Fatalf("a grant with no new release was counted: lat %d wake %d", len(h.lat), len(h.wake))
	}
}

// TestMachineBusy checks the CPU counter behind B2's "machine CPU ms per
// grant": readable here (the bench runs on Linux), and it grows while this
// process spins.
func TestMachineBusy(t *testing.T) {
	b0, ok := machineBusy()
	if !ok {
		t.Fatal("/proc/stat not readable: B2 would report its CPU per grant as not measured")
	}
	end := time.Now().Add(100 * time.Millisecond)
	for time.Now().Before(end) {
	}
	b1, ok := machineBusy()
	if !ok || b1 < b0 {
		t.Fatalf("machineBusy went from %v to %v (ok %v)", b0, b1, ok)
	}
	if b1 == b0 {
		t.Fatalf("machineBusy did not grow over 100 ms of spinning (%v)", b0)
	}
}
