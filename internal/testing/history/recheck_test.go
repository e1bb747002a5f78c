package history

import (
	"encoding/json"
	"os"
	"testing"
)

// TestRecheckSaved checks a history a failing test saved, again:
//
//	PGFENCE_HISTORY=/tmp/pgfence-history-…/history.json go test -run TestRecheckSaved -v ./internal/testing/history
//
// PGFENCE_HISTORY_KEY limits it to one lock, row or job; PGFENCE_HISTORY_LOSSY=1
// allows lost releases (a history with a server crash). Without
// PGFENCE_HISTORY it has nothing to check and passes.
func TestRecheckSaved(t *testing.T) {
	path := os.Getenv("PGFENCE_HISTORY")
	if path == "" {
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var ops []Op
	if err := json.Unmarshal(b, &ops); err != nil {
		t.Fatal(err)
	}
	key := os.Getenv("PGFENCE_HISTORY_KEY")
	var sel []Op
	for _, o := range ops {
		if key != "" && o.Input.Key != key {
			continue
		}
		if o.Input.Kind == Release && os.Getenv("PGFENCE_HISTORY_LOSSY") != "" {
			o.Input.Lossy = true
		}
		sel = append(sel, o)
	}
	vs, sum := Check(sel)
	t.Logf("%v", sum)
	for _, v := range vs {
		t.Errorf("%v", v)
	}
}
