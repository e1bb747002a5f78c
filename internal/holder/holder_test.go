package holder

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestDefault(t *testing.T) {
	a, b := Default(), Default()
	if a == b {
		t.Fatalf("two defaults are equal: %q", a)
	}
	parts := strings.Split(a, "/")
	if len(parts) != 3 || parts[0] == "" || parts[1] != strconv.Itoa(os.Getpid()) || len(parts[2]) != 8 {
		t.Fatalf("Default() = %q, want host/%d/8 hex digits", a, os.Getpid())
	}
}
