package pglock

import (
	"errors"
	"testing"
)

// Bad input is rejected before any SQL runs, with the sentinel and a
// message that says what was wrong; a SQL-looking name is only a value.
func TestValidateNameAndTTL(t *testing.T) {
	if err := validateName(""); err == nil || err.Error() != "pglock: invalid lock name: empty name" {
		t.Errorf(`validateName("") = %v`, err)
	}
	if err := validateName(string(make([]byte, maxNameBytes+1))); !errors.Is(err, ErrInvalidName) {
		t.Errorf("validateName(513 bytes) = %v, want ErrInvalidName", err)
	}
	if err := validateName("x'; DROP TABLE pgfence.locks; --"); err != nil {
		t.Errorf("validateName(SQL-looking) = %v, want nil (a bind parameter)", err)
	}
	if err := validateTTL(0); err == nil || err.Error() != "pglock: invalid lease duration: 0s is outside [1ms, 24h0m0s]" {
		t.Errorf("validateTTL(0) = %v", err)
	}
}
