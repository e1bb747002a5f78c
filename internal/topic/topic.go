// Package topic is the rule for an outbox topic, shared by package outbox
// and the CLI: 1 to MaxBytes bytes of ASCII letters, digits and . _ : / -.
package topic

import "fmt"

// MaxBytes is the longest topic, in bytes.
const MaxBytes = 100

// Check returns nil for an acceptable topic, otherwise an error saying what
// is wrong with it (the caller adds its own sentinel).
func Check(topic string) error {
	if topic == "" || len(topic) > MaxBytes {
		return fmt.Errorf("%d bytes, want 1..%d", len(topic), MaxBytes)
	}
	for i := 0; i < len(topic); i++ {
		c := topic[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == ':' || c == '/' || c == '-') {
			shown := topic
			if len(shown) > 80 {
				shown = shown[:80] + "..."
			}
			return fmt.Errorf("%q: byte %d is %q; use ASCII letters, digits and . _ : / -", shown, i, c)
		}
	}
	return nil
}
