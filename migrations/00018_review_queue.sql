-- The review queue in a browser (`reconciler ui`): its filters, and the
-- reviewer's reading of the breakers.
--
-- The queue lists held receipts oldest first, filtered by dependency,
-- operation or the reason that held them, and counts the matches (at most a
-- bound of them). Without a filter the walk of receipts_held (updated_at)
-- stops at the page's limit; with one, a filter that matches few of many
-- held receipts made that walk read every held row. One partial index per
-- filter, keyed by the filter's value then updated_at, makes each filtered
-- page an ordered range of its own index and each filtered count a range of
-- index entries. Partial like receipts_held: a receipt enters them only when
-- it moves to manual_review, so the hot path (rows that never need review)
-- never touches them. The reason is the one the holding move recorded in
-- state_detail (the history trigger copies it into that move's event).
--
-- An operation belongs to one dependency, which the planner cannot know on
-- its own: filtering by both, it would multiply their selectivities,
-- expect almost no row, and pick a poor index. Functional-dependency
-- statistics on the pair tell it. And the planner reads no statistics of a
-- partial index's expression, so without statistics of their own it would
-- guess how many receipts a reason holds (a fixed half a percent), and
-- walk the reason's index for a reason that holds most of the queue.
--
-- The summary bar shows the shared breaker state: reconciler_reviewer reads
-- dependency_breakers (docs/roles.sql grants it too), granted here where
-- the roles exist so a deployment need not re-apply the roles file.

-- +goose Up
CREATE INDEX receipts_held_dependency ON reconciler.receipts (dependency, updated_at)
    WHERE state = 'manual_review';
CREATE INDEX receipts_held_operation ON reconciler.receipts (operation, updated_at)
    WHERE state = 'manual_review';
CREATE INDEX receipts_held_reason ON reconciler.receipts ((state_detail ->> 'reason'), updated_at)
    WHERE state = 'manual_review';
CREATE STATISTICS reconciler.receipts_dependency_operation (dependencies)
    ON dependency, operation FROM reconciler.receipts;
CREATE STATISTICS reconciler.receipts_reason ON (state_detail ->> 'reason') FROM reconciler.receipts;
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_reviewer') IS NOT NULL THEN
        GRANT SELECT ON reconciler.dependency_breakers TO reconciler_reviewer;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_reviewer') IS NOT NULL THEN
        REVOKE SELECT ON reconciler.dependency_breakers FROM reconciler_reviewer;
    END IF;
END
$$;
-- +goose StatementEnd
DROP STATISTICS reconciler.receipts_reason;
DROP STATISTICS reconciler.receipts_dependency_operation;
DROP INDEX reconciler.receipts_held_reason;
DROP INDEX reconciler.receipts_held_operation;
DROP INDEX reconciler.receipts_held_dependency;
