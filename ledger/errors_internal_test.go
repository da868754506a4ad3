package ledger

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// Issue 7, path 7: the database's refusal of a key (RL007, for a key the
// Go-side check let through, e.g. a retry key another client built wrong)
// is ErrInvalidKey, with the database's message.
func TestIssue7InvalidKeyFromTheDatabase(t *testing.T) {
	c := &Client{}
	pe := &pgconn.PgError{Code: codeInvalidKey, Message: `retry key "x#3" is not "x#2"`}
	err := c.planError(context.Background(), "x#3", pe)
	if !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("planError(RL007) = %v, want ErrInvalidKey", err)
	}
	if !strings.Contains(err.Error(), pe.Message) {
		t.Errorf("error %q lacks the database's message", err)
	}
}
