package outbox

// Internals the external tests check against.
const (
	MaxKeyBytes     = maxKeyBytes
	MaxPayloadBytes = maxPayloadBytes
	QueuePrefix     = queuePrefix
)
