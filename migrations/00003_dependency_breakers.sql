-- +goose Up
-- Shared circuit-breaker state (SPEC §5): each reconciler instance runs its
-- own breaker per dependency, and when one opens it records here until when
-- the dependency should not be called. Every instance reads the row (cached
-- for about a second) and defers its calls while open_until is in the future.
-- Writers keep the later of the stored and the new open_until, so concurrent
-- openings cannot shorten one another. No lock is held across a call.

CREATE TABLE reconciler.dependency_breakers (
    dependency text PRIMARY KEY CHECK (dependency <> ''),
    -- Calls to the dependency are deferred until then, by every instance.
    open_until timestamptz NOT NULL,
    -- The instance that set open_until, and why (e.g. "5 consecutive
    -- transient failures"); for operators, never secrets.
    opened_by  text NOT NULL,
    reason     text NOT NULL DEFAULT '',
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE reconciler.dependency_breakers;
