package reconcile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// Every failed statement is either retried (the database may answer
// later: nothing is given up) or refused for good (nothing is retried
// forever). A SQLSTATE no table names is permanent: holding rows forever is
// the worse mistake.
func TestClassifyDB(t *testing.T) {
	pg := func(code string) error {
		return fmt.Errorf("reconcile: complete 3 rows: %w", &pgconn.PgError{Code: code, Message: "m"})
	}
	for _, c := range []struct {
		name string
		err  error
		want dbFailure
	}{
		{"connection reset", &net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, dbTransient},
		{"EOF", io.ErrUnexpectedEOF, dbTransient},
		{"deadline", context.DeadlineExceeded, dbTransient},
		{"connection failure 08006", pg("08006"), dbTransient},
		{"serialization failure 40001", pg("40001"), dbTransient},
		{"deadlock 40P01", pg("40P01"), dbTransient},
		{"too many connections 53300", pg("53300"), dbTransient},
		{"admin shutdown 57P01", pg("57P01"), dbTransient},
		{"cannot connect now 57P03", pg("57P03"), dbTransient},
		{"statement timeout 57014", pg("57014"), dbTransient},
		{"read-only standby 25006", pg("25006"), dbTransient},
		{"lock timeout 55P03", pg("55P03"), dbTransient},
		{"insufficient privilege 42501", pg("42501"), dbStatementRefused},
		{"undefined table 42P01", pg("42P01"), dbStatementRefused},
		{"undefined column 42703", pg("42703"), dbStatementRefused},
		{"feature not supported 0A000", pg("0A000"), dbStatementRefused},
		{"internal error XX000", pg("XX000"), dbStatementRefused},
		{"invalid text 22021", pg("22021"), dbRowRefused},
		{"check violation 23514", pg("23514"), dbRowRefused},
		{"index row too large 54000", pg("54000"), dbRowRefused},
		{"illegal transition RL001", pg("RL001"), dbRowRefused},
		{"trigger RAISE P0001", pg("P0001"), dbRowRefused},
	} {
		if got := classifyDB(c.err); got != c.want {
			t.Errorf("%s: classifyDB = %d, want %d", c.name, got, c.want)
		}
		if permanentDB(c.err) != (c.want != dbTransient) {
			t.Errorf("%s: permanentDB = %v", c.name, permanentDB(c.err))
		}
	}
	if h := refusalHint(pg("42501")); !strings.Contains(h, "docs/roles.sql") {
		t.Errorf("the hint for 42501 does not point at docs/roles.sql: %q", h)
	}
	if c := sqlStateClass(pg("42501")); c != "42" {
		t.Errorf("class of 42501 = %q", c)
	}
	if c := sqlStateClass(io.EOF); c != "none" {
		t.Errorf("class of EOF = %q", c)
	}
}
