import sqlalchemy as sa


def test_database_url_is_a_fresh_empty_database(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        tables = conn.execute(sa.text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")).scalar()
    engine.dispose()
    assert tables == 0
